"""Soak, CI-sized: requests through the proxy at concurrency 16 with mixed prompt lengths
(including chunked prefills) and ~10 % client aborts, against the single-instance reference.
The long run (1,000 requests) is `python -m vllm_layerkv.testing.soak`, result in
docs/reliability.md."""

from __future__ import annotations

import json

import pytest

from vllm_layerkv.testing.cluster import PDCluster
from vllm_layerkv.testing.soak import SoakConfig, reference_texts, run_soak, soak_prompts

pytestmark = pytest.mark.e2e


def test_soak_no_wrong_no_hung_no_leak(cluster: PDCluster, no_leaks: None) -> None:
    assert cluster.reference is not None and cluster.proxy is not None
    config = SoakConfig(requests=160, concurrency=16, abort_fraction=0.1, max_tokens=12,
                        distinct_prompts=22, seed=7, request_timeout_s=240)
    prompts = soak_prompts(config.distinct_prompts, config.seed)
    refs = reference_texts(cluster.reference.url, prompts, config.max_tokens)
    result = run_soak(cluster.proxy.url, prompts, refs, config)
    report = json.dumps(result.summary(), indent=1)
    assert not result.wrong, report
    assert not result.hung, report
    assert not result.errors, report
    assert result.completed + result.aborted == config.requests, report
    # the aborts did happen, in both phases (seeded: ~16 of 160)
    assert result.aborted_before_answer >= 2 and result.aborted_while_streaming >= 2, report
    assert result.completed >= 130, report
    # both servers still serve after the run (the no_leaks fixture then checks their blocks)
    assert cluster.prefill.poll_ready() and cluster.decode.poll_ready()
