"""One real CPU P/D cluster (reference, prefill, decode, proxy) shared by every e2e test: CPU
vLLM servers take ~40 s and ~3.5 GiB each to start, so they are started once per session.

It stays up from the first test that uses it to the end. Test files with clusters of their
own that must not overlap it (test_hybrid_e2e.py) sort before every file that uses it: a
file named test_first_*.py once started it first, and the 2-core, 24 GiB CI machine ran
out of memory with six servers up."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from vllm_layerkv.testing.cluster import ClusterSpec, PDCluster, wait_idle
from vllm_layerkv.testing.faults import ENV as FAULTS_ENV
from vllm_layerkv.testing.models import model_path
from vllm_layerkv.testing.servers import get_text

# Short robustness timeouts so the failure tests finish quickly (defaults: docs/configuration.md)
PREFILL_EXTRA = {"registration_timeout_s": 6, "ack_timeout_s": 20}
DECODE_EXTRA = {"kv_wait_timeout_s": 45}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    workdir = Path(os.environ.get("LAYERKV_E2E_DIR") or tmp_path_factory.mktemp("pd"))
    # test-only fault hook on P and D: acts only on transfer_ids that ask for a fault
    spec = ClusterSpec(model=model_path("smollm2"), workdir=workdir,
                       prefill_extra=PREFILL_EXTRA, decode_extra=DECODE_EXTRA,
                       connector_env={FAULTS_ENV: "1"})
    with PDCluster(spec) as c:
        yield c


@pytest.fixture
def no_leaks(cluster: PDCluster):
    """After the test, both P and D must return to idle: no requests, no blocks in use; and
    the proxy must hold no request on either (its routing counts, ``in_flight`` in /health)."""
    yield
    for server in (cluster.prefill, cluster.decode):
        readings = wait_idle(server)
        assert not any(readings.values()), f"{server.log_path.stem} leaked: {readings}"
    if cluster.proxy is not None:
        held = proxy_in_flight(cluster.proxy.url)
        deadline = time.monotonic() + 10
        while any(held.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            held = proxy_in_flight(cluster.proxy.url)
        assert not any(held.values()), f"the proxy still counts requests in flight: {held}"


def proxy_in_flight(proxy_url: str) -> dict[str, int]:
    """Each backend's ``in_flight`` from the proxy's /health (200 or 503 alike)."""
    _, text = get_text(proxy_url + "/health")
    report = json.loads(text)
    return {f"{role} {url}": entry["in_flight"] for role in ("prefill", "decode")
            for url, entry in report[role].items()}
