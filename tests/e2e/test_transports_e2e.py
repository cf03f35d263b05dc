"""Each transport end to end with real `vllm serve` P and D on CPU (SmolLM2-135M, float32
greedy): the same prompts through the proxy must give the reference instance's tokens, and P's
log must show the engine that actually moved the KV.

One P/D pair per transport, started in turn (the session cluster's reference instance serves
the expected outputs). NIXL gets no pair of its own: the session cluster runs the default,
``transport: auto``, which picks NIXL where it is installed (as scripts/setup.sh does), and
test_pd_e2e.py checks that cluster's outputs token by token.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prompts import PROMPTS

from vllm_layerkv.testing.cluster import (
    MODEL_NAME,
    ClusterSpec,
    PDCluster,
    transports_used,
    wait_idle,
)
from vllm_layerkv.testing.models import model_path
from vllm_layerkv.testing.servers import post_json
from vllm_layerkv.transport.direct import DirectUnavailable
from vllm_layerkv.transport.nixl import nixl_api

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16
SAMPLE = PROMPTS[::3]  # 8 prompts, short to multi-chunk


def generate(url: str, prompt: str) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    status, data = post_json(url + "/v1/completions", body, timeout=300)
    assert status == 200, f"HTTP {status}: {data}"
    return data["choices"][0]["token_ids"]


def nixl_installed() -> bool:
    try:
        nixl_api()
    except DirectUnavailable:
        return False
    return True


def test_default_transport_is_auto_and_logged(cluster: PDCluster) -> None:
    """The session cluster sets no transport: P logs auto's choice and why at start, and the
    engine it picked for the decode endpoint at the first transfer: NIXL where installed.
    This cluster is then NIXL's end-to-end test (test_pd_e2e.py compares its outputs with the
    reference's token by token)."""
    assert cluster.proxy is not None
    generate(cluster.proxy.url, SAMPLE[-1])
    log = cluster.prefill.log_path.read_text(errors="replace")
    assert "LayerKV transport=auto:" in log
    used = transports_used(log)
    assert used == "nixl" if nixl_installed() else used in ("mooncake", "tcp")


BOUNCE = {"host_bounce": "on", "staging_buffer_mb": 1, "writes_in_flight": 2}
"""``nixl+bounce``: every layer group through D's receive ring in host memory, in 1 MiB pieces
(a 512-token chunk of SmolLM2's 15-layer group is about 12), two in flight."""


@pytest.fixture(scope="module")
def expected(cluster: PDCluster) -> list[list[int]]:
    """The reference's tokens for SAMPLE, 3 at a time as in test_pd_e2e.py: taken once, for
    every transport."""
    assert cluster.reference is not None
    reference_url = cluster.reference.url
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda p: generate(reference_url, p), SAMPLE))


@pytest.mark.parametrize("transport", ["tcp", "mooncake", "nixl+bounce"])
def test_transport_outputs_token_identical(transport: str, expected: list[list[int]],
                                           tmp_path: Path) -> None:
    engine, _, variant = transport.partition("+")
    extra = {"transport": engine, **(BOUNCE if variant == "bounce" else {})}
    spec = ClusterSpec(model=model_path("smollm2"), workdir=tmp_path, with_reference=False,
                       prefill_extra=extra, decode_extra=extra)
    with PDCluster(spec) as pd:
        assert pd.proxy is not None
        proxy_url = pd.proxy.url
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: generate(proxy_url, p), SAMPLE))
        for server in (pd.prefill, pd.decode):
            readings = wait_idle(server)
            assert not any(readings.values()), f"{server.log_path.stem} leaked: {readings}"
        p_log = pd.prefill.log_path.read_text(errors="replace")
        used = transports_used(p_log)
    assert used == engine
    if variant == "bounce":
        assert "through pinned host memory (host_bounce)" in p_log
    mismatches = [i for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not mismatches, f"prompts {mismatches} differ over {transport}"
