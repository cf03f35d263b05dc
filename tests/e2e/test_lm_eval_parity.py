"""Accuracy parity with lm-eval, CI-sized: the same offline tasks through the LayerKV proxy and
against the single instance (SmolLM2-135M, float32, greedy) must give identical scores and
identical per-document responses. The full-task run is documented in docs/accuracy.md.

Each test runs lm-eval against the reference and through the proxy at the same time: they are
separate servers, and lm-eval's own start-up (~10 s of imports) overlaps the other's requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from vllm_layerkv.testing.cluster import MODEL_NAME, PDCluster, metric
from vllm_layerkv.testing.eval_tasks import ARC_TASK, LAMBADA_TASK, build_tasks, run_lm_eval
from vllm_layerkv.testing.models import model_path
from vllm_layerkv.testing.servers import VllmServer

pytestmark = pytest.mark.e2e
LAMBADA_LIMIT = 80  # 120 until 2026-11-24, when CI reached 30 min (full tasks: docs/accuracy.md)
ARC_LIMIT = 40


def finished_requests(server: VllmServer) -> float:
    return metric(server.metrics(), "vllm:request_success_total")


def eval_both(cluster: PDCluster, task: str, limit: int, tasks: Path,
              out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """lm-eval's ``task`` against the reference and through the proxy, concurrently:
    (single's result, P/D's result)."""
    assert cluster.reference is not None and cluster.proxy is not None
    model = model_path("smollm2")
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_lm_eval, url, MODEL_NAME, model, [task], tasks, out / name,
                            limit=limit)
                for url, name in ((cluster.reference.url, "single"), (cluster.proxy.url, "pd"))]
        single, pd = (run.result()[task] for run in runs)
    return single, pd


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


def test_generation_task_identical_through_proxy(cluster: PDCluster, tasks: Path,
                                                 tmp_path: Path, no_leaks: None) -> None:
    """Generative LAMBADA (last word): every prompt's KV goes P -> D; D generates."""
    d_before = finished_requests(cluster.decode)
    single, pd = eval_both(cluster, LAMBADA_TASK, LAMBADA_LIMIT, tasks, tmp_path)
    assert single["scores"]["acc"] >= 0.15, single["scores"]  # the model does the task
    assert pd["responses"] == single["responses"]
    assert pd["scores"] == single["scores"]
    # every document really went through D
    assert finished_requests(cluster.decode) - d_before >= LAMBADA_LIMIT


def test_loglikelihood_task_identical_and_served_by_prefill(cluster: PDCluster, tasks: Path,
                                                            tmp_path: Path,
                                                            no_leaks: None) -> None:
    """ARC-Easy by loglikelihood: lm-eval asks for echoed prompt logprobs, which only a prefill
    instance computes; the proxy sends those requests to P alone (docs/proxy.md)."""
    d_before = finished_requests(cluster.decode)
    p_before = finished_requests(cluster.prefill)
    single, pd = eval_both(cluster, ARC_TASK, ARC_LIMIT, tasks, tmp_path)
    assert pd["scores"] == single["scores"]
    assert pd["responses"] == single["responses"]
    assert single["scores"]["acc"] > 0.3, single["scores"]  # 4 choices: chance is 0.25
    assert finished_requests(cluster.decode) == d_before
    assert finished_requests(cluster.prefill) - p_before >= ARC_LIMIT * 3
