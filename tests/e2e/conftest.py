"""One real CPU P/D cluster (reference, prefill, decode, proxy) shared by every e2e test: CPU
vLLM servers take ~50 s of CPU and ~3.5 GiB each to start, so they are started once for the
whole test run.

It stays up from the first test that uses it to the end. Test files with servers of their own
that do not use it run before every file that does (:func:`pytest_collection_modifyitems`), so
their servers never sit beside it: the 2-core, 24 GiB CI machine once ran out of memory with six
servers up."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from vllm_layerkv.testing.cluster import ClusterSpec, PDCluster, wait_idle
from vllm_layerkv.testing.faults import ENV as FAULTS_ENV
from vllm_layerkv.testing.models import model_path
from vllm_layerkv.testing.servers import VllmServer, get_text

E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the e2e files that do not use the shared cluster before those that do, each group
    in file order; other tests keep their places."""
    slots = [i for i, item in enumerate(items) if E2E_DIR in item.path.parents]
    uses_cluster = {items[i].path for i in slots if "cluster" in items[i].fixturenames}
    ordered = sorted((items[i] for i in slots), key=lambda item: item.path in uses_cluster)
    for i, item in zip(slots, ordered):
        items[i] = item


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
    assert_no_leaks(cluster, (cluster.prefill, cluster.decode))


@pytest.fixture
def prefill_no_leaks(cluster: PDCluster):
    """``no_leaks`` for P alone: for tests that run while D holds another test's request on
    purpose (test_pd_e2e.py's ``kv_never_arrives``), whose own test then checks both."""
    yield
    assert_no_leaks(cluster, (cluster.prefill,))


def assert_no_leaks(cluster: PDCluster, servers: tuple[VllmServer, ...]) -> None:
    for server in servers:
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
