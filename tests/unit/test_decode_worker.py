"""worker/decode.py: where early release applies."""

from __future__ import annotations

from vllm_layerkv.worker.decode import early_release_applies


def test_early_release_applies_with_one_kv_cache_group_on_gpu_or_at_tp1() -> None:
    assert early_release_applies(True, 1, 1, "cpu") == (True, "")
    assert early_release_applies(True, 1, 4, "cuda") == (True, "")


def test_early_release_is_off_where_it_could_not_fail_cleanly_or_would_stall() -> None:
    assert early_release_applies(False, 1, 1, "cuda")[0] is False
    # load errors per block: one KV cache group only
    assert early_release_applies(True, 2, 1, "cuda") == (
        False, "the model has 2 KV cache groups")
    # host-memory KV at TP 2: ranks spin in the CPU all-reduce while one waits for its KV
    assert early_release_applies(True, 1, 2, "cpu") == (False, "KV in host memory at TP 2")
