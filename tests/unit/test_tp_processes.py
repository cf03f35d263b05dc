"""Prefill TP != decode TP across processes, on CPU: one process per rank, as vLLM runs them,
through each network engine's receive ring (NIXL agents, Mooncake TransferEngines), both
directions. The ranks are ``tests/gpu/tp_peer.py`` with its KV in host memory (the same harness
the GPU runs use): P ranks push a 32-block prompt of 8 layers in groups of 4 through the real
``Sender``; every D rank checks every byte of every destination block against the model's KV for
its heads, and that no other block was touched.

``test_tp_transfer.py`` covers the same paths in one process with every layout; this file adds
what only separate processes show: each engine's registration and metadata crossing a real
process boundary (NIXL agent metadata, Mooncake's P2P segment handshake), as between P and D.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TRANSPORTS = os.environ.get("LAYERKV_TEST_TRANSPORTS", "tcp,nixl,mooncake").split(",")
ENGINES = [t for t in ("nixl", "mooncake") if t in TRANSPORTS]
HARNESS = Path(__file__).parents[1] / "gpu" / "test_tp_gpu.py"


def _harness():
    # the harness imports its sibling gpu_skip.py, as it does when run as a script; without
    # this it only worked when pytest had collected tests/gpu/ first (a full run)
    if str(HARNESS.parent) not in sys.path:
        sys.path.append(str(HARNESS.parent))
    spec = importlib.util.spec_from_file_location("tp_gpu_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("transport", ENGINES)
def test_slices_cross_processes_through_the_engine_ring(transport: str, p_tp: int, d_tp: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERKV_TP_PEER_DEVICE", "cpu")
    harness = _harness()
    # 8 KV heads of 8 KiB per block: every route carries 4 heads, 32 KiB per block, so with
    # 1 MiB staging buffers / ring slots a group of 4 layers x 32 blocks goes as 4 writes per
    # route (one layer each): 8 per route for the 2 groups
    p_res, d_res = harness.run_ranks(transport, heads=8, p_tp=p_tp, d_tp=d_tp, blocks=128,
                                     n=32, layers=8, group=4, staging_mb=1)
    harness.assert_exact(p_res, d_res)
    assert all(p["ring"] and p["transport"] == f"tcp+{transport}" for p in p_res), p_res
    routes_per_p_rank = max(1, d_tp // p_tp)
    assert [p["ops"] for p in p_res] == [8 * routes_per_p_rank] * p_tp, p_res
