"""``--first-token-from-prefill`` end to end with the real servers of the session cluster
(SmolLM2-135M, float32, greedy): a second proxy, started with the mode, in front of the same P
and D. Every answer must be token-identical to the single instance's, streamed text included,
while D makes one token fewer per request (P's is the first). Had D sampled a first token of
its own instead of continuing from P's, the answers would repeat a token and differ."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from prompts import PROMPTS

from vllm_layerkv.testing.cluster import MODEL_NAME, PDCluster, metric
from vllm_layerkv.testing.servers import post_json

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
SAMPLE = PROMPTS[::2]  # 12 prompts, short to multi-chunk


@pytest.fixture(scope="module")
def first_token_proxy(cluster: PDCluster, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[str]:
    proxy = cluster.start_proxy(Path(tmp_path_factory.mktemp("ft")) / "proxy.log",
                                "--first-token-from-prefill")
    try:
        yield proxy.url
    finally:
        proxy.stop()


def complete(url: str, prompt: str, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **kw}
    status, data = post_json(url + "/v1/completions", body, timeout=300)
    assert status == 200, f"HTTP {status}: {data}"
    return data


def stream_events(url: str, prompt: str) -> list[dict[str, Any]]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def generated(cluster: PDCluster) -> float:
    """Tokens D has generated so far."""
    return metric(cluster.decode.metrics(), "vllm:generation_tokens_total")


def test_answers_token_identical_and_decode_continues_from_prefills_token(
        cluster: PDCluster, first_token_proxy: str, no_leaks: None) -> None:
    assert cluster.reference is not None
    ref_url = cluster.reference.url
    with ThreadPoolExecutor(3) as pool:
        refs = list(pool.map(lambda p: complete(ref_url, p), SAMPLE))
    gen_before = generated(cluster)
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda p: complete(first_token_proxy, p), SAMPLE))
    gen_after = generated(cluster)
    mismatches = [(i, r["choices"][0]["token_ids"], o["choices"][0]["token_ids"])
                  for i, (r, o) in enumerate(zip(refs, outs))
                  if r["choices"][0]["token_ids"] != o["choices"][0]["token_ids"]]
    assert not mismatches, f"{len(mismatches)} of {len(SAMPLE)} differ: {mismatches[:3]}"
    for r, o in zip(refs, outs):
        assert o["choices"][0]["text"] == r["choices"][0]["text"]
        assert o["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]
        assert o["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
    # D made every token but the first of each answer
    made = sum(len(o["choices"][0]["token_ids"]) - 1 for o in outs)
    assert gen_after - gen_before == made


def test_stream_starts_with_prefills_token(cluster: PDCluster, first_token_proxy: str,
                                           no_leaks: None) -> None:
    assert cluster.reference is not None
    prompt = SAMPLE[-3]
    ref = complete(cluster.reference.url, prompt)
    gen_before = generated(cluster)
    events = stream_events(first_token_proxy, prompt)
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == ref["choices"][0]["text"]
    first = events[0]["choices"][0]
    assert first["text"] and ref["choices"][0]["text"].startswith(first["text"])
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert usage["completion_tokens"] == ref["usage"]["completion_tokens"]
    assert generated(cluster) - gen_before == usage["completion_tokens"] - 1
