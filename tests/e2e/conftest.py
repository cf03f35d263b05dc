"""One real CPU P/D cluster (reference, prefill, decode, proxy) shared by every e2e test: CPU
vLLM servers take ~50 s of CPU and ~3.5 GiB each to start, so they are started once for the
whole test run.

It stays up from the first test that uses it to the end. Test files with servers of their own
that do not use it run before every file that does (:func:`pytest_collection_modifyitems`), so
their servers never sit beside it: the 2-core, 24 GiB CI machine once ran out of memory with six
servers up. A file that ends it (``ENDS_SHARED_CLUSTER = True`` in the module: its last test
kills the cluster's P) runs after every other file that uses it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusters import HYBRID_FILE, MLA_FILE, shared_cluster, stop_clusters_started_early

from vllm_layerkv.testing.cluster import PDCluster, wait_idle
from vllm_layerkv.testing.failure_logs import failure_report
from vllm_layerkv.testing.servers import VllmServer, get_text

E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the e2e files that do not use the shared cluster before those that do, and those
    that end it (``ENDS_SHARED_CLUSTER``) after every other one that uses it, each group in file
    order, except that test_attention_mla_e2e.py runs right after test_hybrid_e2e.py (whose
    last cluster starts its servers); other tests keep their places."""
    slots = [i for i, item in enumerate(items) if E2E_DIR in item.path.parents]
    uses_cluster = {items[i].path for i in slots if "cluster" in items[i].fixturenames}
    ends_cluster = {items[i].path for i in slots
                    if getattr(getattr(items[i], "module", None), "ENDS_SHARED_CLUSTER", False)}
    files = list(dict.fromkeys(items[i].path for i in slots))
    mla = [f for f in files if f.name == MLA_FILE]
    hybrid = [f for f in files if f.name == HYBRID_FILE]
    if mla and hybrid:
        files.remove(mla[0])
        files.insert(files.index(hybrid[0]) + 1, mla[0])
    rank = {path: n for n, path in enumerate(files)}
    ordered = sorted((items[i] for i in slots),
                     key=lambda item: (item.path in uses_cluster, item.path in ends_cluster,
                                       rank[item.path]))
    for i, item in zip(slots, ordered):
        items[i] = item


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report also shows what its servers logged (warnings, errors, the last
    lines): CI keeps no server logs, and an HTTP 500 from the proxy says nothing by itself."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        text = failure_report(_log_folders(item))
        if text:
            report.sections.append(("server logs (warnings, errors, last lines)", text))


def _log_folders(item: pytest.Item) -> list[Path]:
    """The folders of the servers the test's fixtures hold: a PDCluster (also as a fixture's
    ``pd`` or in a tuple) or a single server."""
    folders = []
    values = list(getattr(item, "funcargs", {}).values())
    values += [v for value in values if isinstance(value, tuple) for v in value]
    for value in values:
        pd = value if isinstance(value, PDCluster) else getattr(value, "pd", None)
        if isinstance(pd, PDCluster):
            folders.append(pd.spec.workdir)
        elif isinstance(value, VllmServer):
            folders.append(value.log_path.parent)
    return folders


@pytest.fixture(scope="session", autouse=True)
def _stop_clusters_started_early() -> Iterator[None]:
    yield
    stop_clusters_started_early()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with shared_cluster(tmp_path_factory) as c:
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
