"""The test and benchmark cluster's log readers (``vllm_layerkv.testing.cluster``)."""

from __future__ import annotations

from vllm_layerkv.testing.cluster import transports_used

# P's lines as a vLLM 0.26 prefill instance logs them (2 x H100, 2026-11-28)
WRITES = ("(EngineCore pid=1987) INFO 11-28 00:50:32 [tcp.py:231] LayerKV: writing KV into decode "
          "127.0.0.1:42389 directly via cuda_ipc (CUDA IPC, peer GPU 010c494d)")
READS = ("(EngineCore pid=2989) INFO 11-28 00:51:57 [tcp.py:231] LayerKV: KV read by decode "
         "127.0.0.1:42201 directly via cuda_ipc (CUDA IPC, read by decode GPU 010c494d)")
TCP_READY = ("INFO [worker.py:107] LayerKV worker rank 0/1 ready: 8 layers, 64 blocks x 4096 B, "
             "transport tcp, channels unauthenticated")


def test_a_direct_plane_counts_whether_p_writes_or_d_reads() -> None:
    assert transports_used(WRITES) == "cuda_ipc"
    assert transports_used(READS) == "cuda_ipc"
    assert transports_used(WRITES.replace("cuda_ipc", "nixl") + "\n" + READS) == "cuda_ipc+nixl"


def test_plain_tcp_is_read_from_the_ready_line_and_nothing_said_is_unknown() -> None:
    assert transports_used(TCP_READY) == "tcp"
    assert transports_used("INFO some other line\n") == "unknown"
