"""transport/nixl.py: what D's export tells P about where D's KV is, and how P tells that D's
VRAM is on its own GPU (UCX's cuda_ipc cannot copy between two processes on one GPU, so a
failed WRITE then says what to use instead)."""

from __future__ import annotations

import pytest
import torch
from kv_sides import NUM_BLOCKS, make_caches

from vllm_layerkv.kv.blockio import HostBlockIO
from vllm_layerkv.kv.layout import KVLayout
from vllm_layerkv.transport import nixl
from vllm_layerkv.transport.direct import host_id
from vllm_layerkv.wire.planes import NixlExport


def export(mem_type: str = "VRAM", host: str | None = None, uuid: str = "GPU-a") -> NixlExport:
    return NixlExport(agent_name="d", agent_metadata=b"", mem_type=mem_type, device_id=0,
                      num_blocks=1, block_bytes=1, layer_addrs=[0],
                      host_id=host_id() if host is None else host, device_uuid=uuid)


@pytest.fixture
def gpu_a(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """cuda:0 with UUID GPU-a (no GPU needed: only the identity is asked for)."""
    monkeypatch.setattr(nixl, "device_uuid", lambda device: "GPU-a")
    return torch.device("cuda", 0)


def test_d_on_p_own_gpu_is_told_apart(gpu_a: torch.device) -> None:
    assert nixl.shares_gpu(export(), gpu_a)
    assert not nixl.shares_gpu(export(uuid="GPU-b"), gpu_a)           # the host's other GPU
    assert not nixl.shares_gpu(export(host="other/boot"), gpu_a)      # another host
    assert not nixl.shares_gpu(export(mem_type="DRAM", uuid=""), gpu_a)
    assert not nixl.shares_gpu(export(), torch.device("cpu"))         # P's KV in host memory


def test_one_gpu_hint_says_what_to_use() -> None:
    assert "transport=auto" in nixl.ONE_GPU_HINT and "UCX_TLS=tcp" in nixl.ONE_GPU_HINT


def test_a_host_memory_export_names_its_host_and_no_gpu() -> None:
    pytest.importorskip("nixl")
    blocks = HostBlockIO(KVLayout.from_kv_caches(make_caches(0), NUM_BLOCKS))
    plane = nixl.NixlPlane(blocks.tensors)
    try:
        plane.prepare()
        ex = plane._export
        assert (ex.mem_type, ex.host_id, ex.device_uuid) == ("DRAM", host_id(), "")
    finally:
        plane.shutdown()


@pytest.mark.parametrize(("nbytes", "parts", "expected"), [
    (8 << 20, 4, [(0, 2 << 20), (2 << 20, 2 << 20), (4 << 20, 2 << 20), (6 << 20, 2 << 20)]),
    (8 << 20, 1, [(0, 8 << 20)]),
    (8 << 20, 0, [(0, 8 << 20)]),                      # no thread pool: one descriptor
    (3 << 20, 8, [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 1 << 20)]),  # none below 1 MiB
    (1000, 4, [(0, 1000)]),                            # a small write stays whole
    (0, 4, [(0, 0)]),
    ((5 << 20) + 3, 2, [(0, (5 << 20) // 2 + 2), ((5 << 20) // 2 + 2, (5 << 20) // 2 + 1)]),
])
def test_a_ring_write_is_cut_into_one_descriptor_per_thread(nbytes, parts, expected) -> None:
    cuts = nixl.span_cuts(nbytes, parts)
    assert cuts == expected
    assert sum(n for _, n in cuts) == nbytes
    assert all(off + n == nxt for (off, n), (nxt, _) in zip(cuts, cuts[1:]))


def test_only_an_agent_with_ucx_alone_gets_threads() -> None:
    assert nixl.ucx_threads(["UCX"], 4) == 4
    assert nixl.ucx_threads([" UCX "], 4) == 4
    assert nixl.ucx_threads(["UCX", "LIBFABRIC"], 4) == 0
    assert nixl.ucx_threads(["LIBFABRIC"], 4) == 0
