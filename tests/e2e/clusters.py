"""The shared e2e cluster's settings, and clusters that a test module starts before their own
tests come.

A CPU server's start-up is ~45 s of CPU, mostly Python imports one process after another, and
the tests before it often leave a core idle while P and D wait on each other: a module whose
last cluster is up may start the next cluster's servers (:func:`start_early`) when both fit in
memory (the 2-core, 24 GiB CI machine once ran out of memory with six servers up). The tests
that use that cluster take it with :func:`take_started_early` and start it the usual way,
which waits for its servers and starts its proxy; conftest.py stops one that nothing took."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_layerkv.testing.cluster import ClusterSpec, PDCluster
from vllm_layerkv.testing.faults import ENV as FAULTS_ENV
from vllm_layerkv.testing.models import model_path

# Short robustness timeouts so the failure tests finish quickly (defaults: docs/configuration.md)
PREFILL_EXTRA = {"registration_timeout_s": 6, "ack_timeout_s": 20}
DECODE_EXTRA = {"kv_wait_timeout_s": 45}

def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> PDCluster:
    """The shared cluster (conftest.py's ``cluster``), not started yet."""
    workdir = Path(os.environ.get("LAYERKV_E2E_DIR") or tmp_path_factory.mktemp("pd"))
    # test-only fault hook on P and D: acts only on transfer_ids that ask for a fault
    spec = ClusterSpec(model=model_path("smollm2"), workdir=workdir,
                       prefill_extra=PREFILL_EXTRA, decode_extra=DECODE_EXTRA,
                       connector_env={FAULTS_ENV: "1"})
    return PDCluster(spec)


MLA = "mla"
"""test_attention_mla_e2e.py's cluster: it runs right after test_hybrid_e2e.py (conftest.py),
whose last cluster starts it."""
MLA_FILE = "test_attention_mla_e2e.py"
HYBRID_FILE = "test_hybrid_e2e.py"


def mla_cluster(tmp_path_factory: pytest.TempPathFactory) -> PDCluster:
    """test_attention_mla_e2e.py's cluster, not started yet."""
    workdir = tmp_path_factory.mktemp("mla")
    spec = ClusterSpec(model=model_path("tiny-deepseek"), workdir=workdir,
                       enable_prefix_caching=False,  # vLLM forces it off for MLA on CPU
                       common_args=["--attention-backend", "CPU_MLA"])
    return PDCluster(spec)


def item_after(session: pytest.Session, path: Path) -> pytest.Item | None:
    """The test that runs right after the tests of file ``path``, if any."""
    items = session.items
    after = [i + 1 for i, item in enumerate(items) if item.path == path]
    return items[after[-1]] if after and after[-1] < len(items) else None


STARTED_EARLY: dict[str, PDCluster] = {}
"""Clusters whose servers were started before their tests, by name."""


def start_early(name: str, cluster: PDCluster) -> None:
    """Start ``cluster``'s servers now, without waiting for them (its proxy starts with its
    tests)."""
    if name in STARTED_EARLY:
        return
    STARTED_EARLY[name] = cluster
    for server in cluster.servers:
        server.start()


def take_started_early(name: str) -> PDCluster | None:
    return STARTED_EARLY.pop(name, None)


def stop_clusters_started_early() -> None:
    while STARTED_EARLY:
        STARTED_EARLY.popitem()[1].stop()
