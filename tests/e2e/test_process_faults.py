"""Failures that need servers of their own, or end one: a prefill or decode process killed
(SIGKILL) while KV streams, a decode instance whose KV layout does not match the prefill's, and
kv_load_failure_policy=recompute after a failed transfer (also one that fails after D released
the request early).

The shared e2e cluster's prefill instance (conftest.py) serves every test here, as a P serves
several D in xPyD; the cases get decode instances of their own, started together: one with
another block size (on P's core), and one with the recompute policy, which the decode-killed
test then kills (once the recompute tests are done with it: what P does when its D dies does
not depend on D's policy). The last test kills the shared P itself, beside the shared D, so this
file runs after every other file that uses the shared cluster (``ENDS_SHARED_CLUSTER``,
conftest.py). Log checks on P read only what P wrote during the test, since P also logs the
other tests' failures."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from prompts import make_prompt

from vllm_layerkv.testing import faults
from vllm_layerkv.testing.cluster import PDCluster, log_since, wait_idle
from vllm_layerkv.testing.servers import start_all, stop_all

pytestmark = pytest.mark.e2e
# ~1,350 tokens each: 6 chunks of 256, seconds on one CPU core. One prompt per kill test: P keeps
# a prompt's blocks in its prefix cache, and a prompt P computed before streams all its KV in
# one step, before the test can kill anything.
DECODE_KILLED_PROMPT = make_prompt(1200, 31)
PREFILL_KILLED_PROMPT = make_prompt(1200, 37)

ENDS_SHARED_CLUSTER = True
"""The last test kills the shared cluster's P: conftest.py runs this file after every other
file that uses the shared cluster."""


@pytest.fixture(scope="module")
def pairs(cluster: PDCluster) -> Iterator[dict[str, PDCluster]]:
    """The shared P with each case's D, by case: "layout" (D with block size 32), "recompute"
    (kv_load_failure_policy=recompute, and early release 1 s before P's estimate, so that a
    transfer failing at its end fails after D released the request), "decode_killed" (the
    recompute case's D, killed after the recompute tests) and "prefill_killed" (the shared
    cluster itself: its P is killed beside its plain D)."""
    recompute = cluster.with_another_decode(
        "decode-recompute", kv_config={"kv_load_failure_policy": "recompute"},
        extra={**cluster.spec.decode_extra, "early_release_lead_ms": 1000})
    # on P's core: P refuses its registration, so it never receives KV, and it starts beside
    # the recompute D instead of queueing behind it on the decode core (a server's worker runs
    # on its bound core from its first import)
    layout = cluster.with_another_decode("decode-block32", args=["--block-size", "32"],
                                         cpus=cluster.spec.prefill_cpus)
    by_case = {
        "layout": layout,
        "recompute": recompute,
        "decode_killed": recompute,
        "prefill_killed": cluster,
    }
    servers = [layout.decode, recompute.decode]
    start_all(servers, timeout=900)
    try:
        yield by_case
    finally:
        stop_all(servers)


def assert_idle(cluster: PDCluster, *which: str) -> None:
    for name in which:
        readings = wait_idle(getattr(cluster, name), timeout=30)
        assert not any(readings.values()), f"{name} leaked: {readings}"


def log_size(path: Path) -> int:
    return path.stat().st_size


def test_kv_layout_mismatch_is_refused_at_registration(pairs: dict[str, PDCluster]) -> None:
    """D runs with another block size than P: P refuses D's registration naming the differing
    field, and D fails the request at once instead of waiting for KV."""
    cluster = pairs["layout"]
    d, (p_status, _) = cluster.prefill_and_decode(uuid.uuid4().hex, make_prompt(200, 32))
    assert d["status"] >= 500, d
    assert d["elapsed"] < 15, d
    assert "Traceback" not in json.dumps(d["data"])
    assert "block_size" in cluster.decode.log_path.read_text()
    assert_idle(cluster, "decode", "prefill")


def failure_line(cluster: PDCluster, transfer_id: str) -> str:
    """D's log line that says why the transfer failed."""
    for line in cluster.decode.log_path.read_text(errors="replace").splitlines():
        if f"LayerKV transfer {transfer_id} (request" in line:
            return line
    raise AssertionError(f"D's log has no failure of transfer {transfer_id}")


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
        pairs: dict[str, PDCluster]) -> None:
    """kv_load_failure_policy=recompute on D: a transfer that fails (fault hook: its first
    write already, so before D could release it early) is recomputed on D, and the answer
    equals what D computes for the prompt on its own."""
    line = recomputed_failure(pairs["recompute"], faults.WRITE_FAULT_PREFIX, 33)
    assert "injected write fault" in line and "released early" not in line, line


def test_transfer_failing_after_early_release_is_recomputed(
        pairs: dict[str, PDCluster]) -> None:
    """D released the request early (P said its last group was coming) and then the last group
    failed: vLLM gets the request's blocks as load errors in the step that runs it and, with
    kv_load_failure_policy=recompute, recomputes it; the answer equals D's own."""
    line = recomputed_failure(pairs["recompute"], faults.LATE_WRITE_FAULT_PREFIX, 35)
    assert "released early) failed" in line and "injected write fault" in line, line


def test_decode_killed_while_prefill_streams(pairs: dict[str, PDCluster]) -> None:
    """D is SIGKILLed while P streams into it: P's sender loses the connection, P still answers
    its own request, and frees the request's blocks at once (no acknowledgement will come).
    Runs after the recompute tests, whose D it kills. The transfer goes over a slow link (fault
    hook), so the kill lands mid-stream even when the machine delivers it seconds late."""
    cluster = pairs["decode_killed"]
    tid = faults.SLOW_WRITE_PREFIX + uuid.uuid4().hex
    p_log_start = log_size(cluster.prefill.log_path)
    d, (p_status, _) = cluster.prefill_and_decode(tid, DECODE_KILLED_PROMPT,
                                                  on_streaming=cluster.decode.kill)
    assert "on_streaming" not in d, d
    assert p_status == 200
    assert_idle(cluster, "prefill")
    p_events = [e["ev"] for e in cluster.trace_events() if tid in json.dumps(e)]
    assert "transfer_done_sent" not in p_events, p_events  # else the kill came too late
    assert re.search(rf"LayerKV transfer {tid} \(request .*\) to .* failed",
                     log_since(cluster.prefill.log_path, p_log_start)), p_events
    assert cluster.prefill.poll_ready()


def test_prefill_killed_mid_stream_fails_decode(pairs: dict[str, PDCluster]) -> None:
    """P is SIGKILLed while it streams: D sees the data connection drop and fails the request
    well before kv_wait_timeout_s, and frees its blocks. The file's last test: P is gone
    afterwards. A slow link (fault hook) keeps the stream going until the kill lands."""
    cluster = pairs["prefill_killed"]
    tid = faults.SLOW_WRITE_PREFIX + uuid.uuid4().hex
    d, _ = cluster.prefill_and_decode(tid, PREFILL_KILLED_PROMPT,
                                      on_streaming=cluster.prefill.kill)
    # what P did with the transfer before it died: one step_plan per chunk it streamed, and
    # nearly_done_sent if it got to the last one (then the kill came too late to test anything)
    p_events = [e["ev"] for e in cluster.trace_events() if tid in json.dumps(e)]
    assert "on_streaming" not in d, d
    assert d["status"] >= 500, (d, p_events)
    assert d["elapsed"] < 30, d
    assert_idle(cluster, "decode")
    assert cluster.decode.poll_ready()  # D still serves
