"""benchmarks/pyspy_summary.py: thread and LayerKV shares from py-spy raw profiles."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import load

pyspy_summary = load("pyspy_summary")

BOOT = ("Thread._bootstrap (threading.py:1030);Thread._bootstrap_inner (threading.py:1073);"
        "Thread.run (threading.py:1010);")
RAW = "\n".join([
    # the engine thread in vLLM's forward, then in a LayerKV hook
    "<module> (<string>:1);run_busy_loop (vllm/v1/engine/core.py:1364);"
    "forward (vllm/model.py:10) 90",
    "<module> (<string>:1);run_busy_loop (vllm/v1/engine/core.py:1364);"
    "LayerKVConnector.save_kv_layer (vllm_layerkv/connector.py:98) 4",
    # LayerKV's sender thread, and a vLLM thread
    BOOT + "Sender._run (vllm_layerkv/worker/sender.py:172);copy_blocks "
    "(vllm_layerkv/transport/cuda_ipc.py:67) 5",
    BOOT + "EngineCoreProc.process_input_sockets (vllm/v1/engine/core.py:1656) 1",
    "",
])


def test_threads_and_layerkv_share(tmp_path: Path) -> None:
    path = tmp_path / "p.gil.txt"
    path.write_text(RAW)
    total, threads, layerkv = pyspy_summary.summarise(path)
    assert total == 100
    assert threads == {"main thread": 94, "Sender._run": 5,
                       "EngineCoreProc.process_input_sockets": 1}
    assert layerkv == 9  # the hook on the engine thread + the sender


def test_empty_profile(tmp_path: Path) -> None:
    path = tmp_path / "idle.gil.txt"
    path.write_text("")
    assert pyspy_summary.summarise(path) == (0, {}, 0)
