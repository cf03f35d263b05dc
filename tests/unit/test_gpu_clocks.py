"""benchmarks/gpu_clocks.py: GPU clocks, power and clock-event reasons over a point, by role.
NVML is replaced by a stand-in GPU host (this machine has no NVIDIA driver) whose clocks the
test sets while the sampler runs; where NVML does not start, a point says why."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from benchmark_scripts import load

gpu_clocks = load("gpu_clocks")
ttft_bench = load("ttft_bench")


class StandInNvml:
    """pynvml's calls that the sampler makes, over GPUs whose readings the test sets. GPU 1
    also answers to a UUID; ``broken`` GPUs fail every read after their first sample."""

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, gpus: int = 2, start_fails: bool = False) -> None:
        self.readings = {i: {"sm": 1980, "mem": 3201, "mw": 300_000, "util": 90, "bits": 0}
                         for i in range(gpus)}
        self.reads = {i: 0 for i in range(gpus)}
        self.broken: set[int] = set()
        self.start_fails = start_fails
        self.initialized = 0
        self.lock = threading.Lock()

    def nvmlInit(self) -> None:
        if self.start_fails:
            raise RuntimeError("NVML Shared Library Not Found")
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.initialized -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.readings:
            raise RuntimeError("Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        if uuid != "GPU-1111":
            raise RuntimeError("Not Found")
        return 1

    def nvmlDeviceGetMaxClockInfo(self, handle: int, kind: int) -> int:
        return 1980 if kind == self.NVML_CLOCK_SM else 3201

    def _read(self, handle: int, key: str) -> Any:
        with self.lock:
            if handle in self.broken and self.reads[handle] > 0:
                raise RuntimeError("GPU is lost")
            if key == "bits":  # a sample's last read
                self.reads[handle] += 1
            return self.readings[handle][key]

    def nvmlDeviceGetClockInfo(self, handle: int, kind: int) -> int:
        return self._read(handle, "sm" if kind == self.NVML_CLOCK_SM else "mem")

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._read(handle, "mw")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._read(handle, "util"), memory=0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return self._read(handle, "bits")


def wait_for_reads(nvml: StandInNvml, gpu: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while nvml.reads[gpu] < n:
        assert time.monotonic() < deadline, f"GPU {gpu}: {nvml.reads[gpu]} reads of {n}"
        time.sleep(0.005)


def test_each_role_s_gpus_are_sampled_while_the_point_runs() -> None:
    """D's GPU drops its clock and goes idle for part of the point: its summary shows the range,
    the median and the share of samples with each reason; P's GPU stays at its maximum."""
    nvml = StandInNvml()
    with gpu_clocks.GpuSampler({"prefill": ["0"], "decode": ["1"]}, interval_s=0.001,
                               nvml=nvml) as sampler:
        wait_for_reads(nvml, 1, 30)
        with nvml.lock:
            nvml.readings[1].update(sm=1410, mw=150_000, util=40, bits=0x1 | 0x4)
            mark = nvml.reads[1]
        wait_for_reads(nvml, 1, 2 * mark + 30)  # more samples after the drop than before
    assert nvml.initialized == 0  # shut down again
    summary = sampler.summary()
    assert set(summary) == {"prefill", "decode"}
    p, d = summary["prefill"]["0"], summary["decode"]["1"]
    assert p["sm_mhz"] == {"median": 1980, "min": 1980, "max": 1980, "gpu_max": 1980}
    assert p["clock_event_reasons"] == {} and p["power_w_median"] == 300.0
    assert d["samples"] >= 90 and "error" not in d
    assert d["sm_mhz"]["min"] == 1410 and d["sm_mhz"]["max"] == 1980
    assert d["sm_mhz"]["median"] == 1410  # most samples came after the drop
    low = d["clock_event_reasons"]
    assert set(low) == {"gpu_idle", "sw_power_cap"} and low["gpu_idle"] == low["sw_power_cap"]
    assert 0.5 < low["gpu_idle"] < 1
    line = gpu_clocks.one_line(summary)
    assert "decode GPU 1: SM 1410 MHz (1410-1980 of 1980)" in line
    assert "gpu_idle" in line and "prefill GPU 0: SM 1980 MHz" in line


def test_gpus_named_by_uuid_and_a_gpu_lost_mid_point() -> None:
    """A GPU given by UUID is read through its handle; a GPU whose reads start failing keeps
    the samples taken before, with the reason, and does not stop the others."""
    nvml = StandInNvml(gpus=3)
    nvml.broken.add(2)
    with gpu_clocks.GpuSampler({"decode": ["GPU-1111", "2"], "missing": ["7"]},
                               interval_s=0.001, nvml=nvml) as sampler:
        wait_for_reads(nvml, 1, 20)
    summary = sampler.summary()
    assert summary["decode"]["GPU-1111"]["samples"] >= 20
    lost = summary["decode"]["2"]
    assert lost["samples"] == 1 and "sampling stopped: GPU is lost" in lost["error"]
    assert summary["missing"]["7"] == {"samples": 0, "error": "no handle: Invalid Argument"}
    assert "missing GPU 7: no samples (no handle: Invalid Argument)" in \
        gpu_clocks.one_line(summary)


def test_where_nvml_does_not_start_the_point_says_why() -> None:
    with gpu_clocks.GpuSampler({"decode": ["0"]}, nvml=StandInNvml(start_fails=True)) as s:
        pass
    assert s.summary() == {"unavailable": "NVML did not start: NVML Shared Library Not Found"}
    assert gpu_clocks.one_line(s.summary()).startswith("not sampled: NVML did not start")


def test_no_gpus_no_sampling() -> None:
    """On CPU the benchmark passes no GPUs: nothing starts, nothing is recorded."""
    nvml = StandInNvml(start_fails=True)  # would say so if it were started
    with gpu_clocks.GpuSampler({}, nvml=nvml) as s:
        pass
    assert s.summary() == {}


def test_reason_names_keep_unknown_bits() -> None:
    assert gpu_clocks.reason_names(0) == []
    assert gpu_clocks.reason_names(0x1 | 0x40) == ["gpu_idle", "hw_thermal_slowdown"]
    assert gpu_clocks.reason_names(0x4 | 0x10000) == ["sw_power_cap", "0x10000"]


@pytest.mark.parametrize("device, expected", [
    ("cuda", {"prefill": ["2"], "decode": ["3"]}),
    ("cpu", {}),
])
def test_the_benchmark_samples_each_instance_s_host_gpus(monkeypatch: pytest.MonkeyPatch,
                                                         device: str,
                                                         expected: dict[str, list[str]]) -> None:
    """With CUDA_VISIBLE_DEVICES=2,3 around the benchmark, its GPUs 0 and 1 are the host's 2
    and 3, which is how NVML numbers them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    config = ttft_bench.parse_config("layerkv")
    deployment = ttft_bench.Deployment([], instances=ttft_bench.layout(config, 2))
    assert ttft_bench.gpus_by_role(deployment, device) == expected
