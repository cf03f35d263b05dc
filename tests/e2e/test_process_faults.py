"""Failures that need servers of their own: a prefill or decode process killed (SIGKILL) while
KV streams, a decode instance whose KV layout does not match the prefill's, and
kv_load_failure_policy=recompute after a failed transfer (also one that fails after D released
the request early). Each kill and the layout mismatch start their own P + D (no reference,
~45 s on CPU) beside the shared e2e cluster; the two recompute tests share one pair."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prompts import make_prompt

from vllm_layerkv.testing import faults
from vllm_layerkv.testing.cluster import ClusterSpec, PDCluster, wait_idle
from vllm_layerkv.testing.models import model_path

pytestmark = pytest.mark.e2e
LONG_PROMPT = make_prompt(2800, 31)  # ~3,100 tokens: ~12 chunks of 256 on P


def start_pair(tmp_path: Path, **spec_kw) -> PDCluster:
    spec = ClusterSpec(model=model_path("smollm2"), workdir=tmp_path, with_reference=False,
                       prefill_extra={"registration_timeout_s": 6, "ack_timeout_s": 20},
                       decode_extra={"kv_wait_timeout_s": 45,
                                     **spec_kw.pop("decode_extra", {})},
                       connector_env={faults.ENV: "1"}, **spec_kw)
    return PDCluster(spec).start()


def assert_idle(cluster: PDCluster, *which: str) -> None:
    for name in which:
        readings = wait_idle(getattr(cluster, name), timeout=30)
        assert not any(readings.values()), f"{name} leaked: {readings}"


def test_prefill_killed_mid_stream_fails_decode(tmp_path: Path) -> None:
    """P is SIGKILLed while it streams: D sees the data connection drop and fails the request
    well before kv_wait_timeout_s, and frees its blocks."""
    cluster = start_pair(tmp_path)
    try:
        d, _ = cluster.prefill_and_decode(uuid.uuid4().hex, LONG_PROMPT,
                                          on_streaming=cluster.prefill.kill)
        assert d["status"] >= 500, d
        assert d["elapsed"] < 30, d
        assert_idle(cluster, "decode")
        assert cluster.decode.poll_ready()  # D still serves
    finally:
        cluster.stop()


def test_decode_killed_while_prefill_streams(tmp_path: Path) -> None:
    """D is SIGKILLed while P streams into it: P's sender loses the connection, P still answers
    its own request, and frees the request's blocks at once (no acknowledgement will come)."""
    cluster = start_pair(tmp_path)
    try:
        _, (p_status, _) = cluster.prefill_and_decode(uuid.uuid4().hex, LONG_PROMPT,
                                                      on_streaming=cluster.decode.kill)
        assert p_status == 200
        assert_idle(cluster, "prefill")
        assert re.search(r"LayerKV transfer \S+ \(request .*\) to .* failed",
                         cluster.prefill.log_path.read_text())
        assert cluster.prefill.poll_ready()
    finally:
        cluster.stop()


def test_kv_layout_mismatch_is_refused_at_registration(tmp_path: Path) -> None:
    """D runs with another block size than P: P refuses D's registration naming the differing
    field, and D fails the request at once instead of waiting for KV."""
    cluster = start_pair(tmp_path, decode_args=["--block-size", "32"])
    try:
        d, (p_status, _) = cluster.prefill_and_decode(uuid.uuid4().hex, make_prompt(200, 32))
        assert d["status"] >= 500, d
        assert d["elapsed"] < 15, d
        assert "Traceback" not in json.dumps(d["data"])
        assert "block_size" in cluster.decode.log_path.read_text()
        assert_idle(cluster, "decode", "prefill")
    finally:
        cluster.stop()


def failure_line(cluster: PDCluster, transfer_id: str) -> str:
    """D's log line that says why the transfer failed."""
    for line in cluster.decode.log_path.read_text(errors="replace").splitlines():
        if f"LayerKV transfer {transfer_id} (request" in line:
            return line
    raise AssertionError(f"D's log has no failure of transfer {transfer_id}")


@pytest.fixture(scope="module")
def recompute_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    """D with kv_load_failure_policy=recompute, and early release 1 s before P's estimate, so
    that a transfer failing at its end fails after D released the request."""
    cluster = start_pair(tmp_path_factory.mktemp("recompute"),
                         decode_kv_config={"kv_load_failure_policy": "recompute"},
                         decode_extra={"early_release_lead_ms": 1000})
    try:
        yield cluster
    finally:
        cluster.stop()


def recomputed_failure(cluster: PDCluster, fault_prefix: str, seed: int) -> str:
    """Send a prompt whose transfer the fault hook breaks; D must answer what it computes for
    the prompt on its own. Returns D's log line of the failure."""
    prompt = make_prompt(300, seed)
    tid = fault_prefix + uuid.uuid4().hex
    d, _ = cluster.prefill_and_decode(tid, prompt, max_tokens=12)
    assert d["status"] == 200, d
    # afterwards (before, D's prefix cache would have made the transfer unnecessary)
    local = cluster.decode.completion(prompt, 12)["choices"][0]["text"]
    assert d["data"]["choices"][0]["text"] == local
    line = failure_line(cluster, tid)
    assert_idle(cluster, "decode", "prefill")
    return line


def test_recompute_policy_serves_the_request_after_a_failed_transfer(
        recompute_pair: PDCluster) -> None:
    """kv_load_failure_policy=recompute on D: a transfer that fails (fault hook: its first
    write already, so before D could release it early) is recomputed on D, and the answer
    equals what D computes for the prompt on its own."""
    line = recomputed_failure(recompute_pair, faults.WRITE_FAULT_PREFIX, 33)
    assert "injected write fault" in line and "released early" not in line, line


def test_transfer_failing_after_early_release_is_recomputed(recompute_pair: PDCluster) -> None:
    """D released the request early (P said its last group was coming) and then the last group
    failed: vLLM gets the request's blocks as load errors in the step that runs it and, with
    kv_load_failure_policy=recompute, recomputes it; the answer equals D's own."""
    line = recomputed_failure(recompute_pair, faults.LATE_WRITE_FAULT_PREFIX, 35)
    assert "released early) failed" in line and "injected write fault" in line, line
