"""GPU clocks, power, utilization and clock-event (throttle) reasons over one benchmark point,
read from NVML, for each GPU of a configuration by role.

Why: under open-loop load NixlConnector's D took 0.14-0.20 ms (3-4 %) less per decode step
than a plain vLLM instance, and only in P/D (benchmarks/results/2026-11-27-x4-h200-decode-steps).
A step at one request is bound by the GPU, so a GPU that runs at other clocks would explain it:
its D's GPU does the copying of each request's KV (UCX's cuda_ipc reads), where LayerKV's D
GPU receives writes that P's GPU makes, and a GPU's clocks follow how busy it is. This records
what NVML reports every ``INTERVAL_S`` while a point runs, so that the load and rate points say
whether the GPUs ran at the same clocks in every configuration. (They did: every D GPU at its
maximum, 1,980 MHz on H200, under both connectors; the difference was in D's CUDA graph,
benchmarks/results/2026-11-27-x4-h200-decode-graphs. Clocks still matter elsewhere: a busy P
runs at its power cap.)

NVML comes from ``pynvml`` (nvidia-ml-py), or else the copy vLLM ships
(``vllm.third_party.pynvml``). Where neither loads or NVML does not start (no NVIDIA driver), a
point records why instead of samples. NVML numbers GPUs as the host does: the GPU ids here are
the host's (``ttft_bench.Instance.visible``), by index or by UUID.

Used by ``ttft_bench.py`` for every load and rate point on CUDA (``gpu`` in summary.json).
"""

from __future__ import annotations

import statistics
import threading
from types import ModuleType, TracebackType
from typing import Any

INTERVAL_S = 0.05
"""How often each GPU is read: 20 times a second, 400 samples over a 20 s point; one read of
the five values takes well under a millisecond."""

CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""NVML's ``nvmlClocksEventReason*`` bits (formerly ``nvmlClocksThrottleReason*``): why the
GPU's clocks are below their maximum at the moment of a sample."""


def load_nvml() -> ModuleType | None:
    """The pynvml module, or None where it is not installed."""
    try:
        import pynvml
        return pynvml
    except ImportError:
        pass
    try:
        from vllm.third_party import pynvml as vendored
        return vendored
    except ImportError:
        return None


def reason_names(bits: int) -> list[str]:
    """The names of the clock-event reasons set in ``bits`` (unknown bits as hex)."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if bits & bit]
    unknown = bits & ~sum(CLOCK_EVENT_REASONS)
    return names + ([hex(unknown)] if unknown else [])


class GpuSampler:
    """Samples the GPUs of each role in a thread of its own while the ``with`` block runs.

    ``gpus``: role -> the host's GPU ids (an index, or a UUID ``GPU-...``). ``nvml``: the
    pynvml module to use (tests pass a stand-in); by default :func:`load_nvml`'s."""

    def __init__(self, gpus: dict[str, list[str]], interval_s: float = INTERVAL_S,
                 nvml: ModuleType | Any | None = None) -> None:
        self.gpus = {role: list(ids) for role, ids in gpus.items() if ids}
        self.interval_s = interval_s
        self._nvml = nvml
        self._samples: dict[str, list[tuple[int, int, float, int, int]]] = {}
        self._max_sm_mhz: dict[str, int | None] = {}
        self._errors: dict[str, str] = {}
        self._unavailable: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        if not self.gpus:
            return self
        nvml = self._nvml if self._nvml is not None else load_nvml()
        if nvml is None:
            self._unavailable = "pynvml is not installed (nvidia-ml-py, or vLLM's copy)"
            return self
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError: no driver, no GPU
            self._unavailable = f"NVML did not start: {e}"
            return self
        self._nvml = nvml
        handles = {}
        for gpu in sorted({g for ids in self.gpus.values() for g in ids}):
            try:
                handles[gpu] = (nvml.nvmlDeviceGetHandleByUUID(gpu) if gpu.startswith("GPU-")
                                else nvml.nvmlDeviceGetHandleByIndex(int(gpu)))
                self._max_sm_mhz[gpu] = nvml.nvmlDeviceGetMaxClockInfo(handles[gpu],
                                                                       nvml.NVML_CLOCK_SM)
            except Exception as e:
                self._errors[gpu] = f"no handle: {e}"
                handles.pop(gpu, None)
            self._samples[gpu] = []
        self._thread = threading.Thread(target=self._run, args=(handles,), daemon=True,
                                        name="gpu-clocks")
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._nvml is not None and self._unavailable is None and self.gpus:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def _run(self, handles: dict[str, Any]) -> None:
        nvml = self._nvml
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while True:
            for gpu, handle in list(handles.items()):
                try:
                    self._samples[gpu].append((
                        nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                        nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
                        nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                        nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                        reasons(handle)))
                except Exception as e:  # keep what was read; say why the rest is missing
                    self._errors[gpu] = f"sampling stopped: {e}"
                    del handles[gpu]
            if not handles or self._stop.wait(self.interval_s):
                return

    def summary(self) -> dict[str, Any]:
        """Per role, per GPU: how many samples, the SM clock's median / min / max against the
        GPU's maximum, the memory clock's and the power's median, the median utilization (%
        of the sample period with a kernel running, as NVML defines it), and for each
        clock-event reason the fraction of samples that had it. ``{"unavailable": why}`` where
        NVML could not be used; ``{}`` where there were no GPUs to sample."""
        if self._unavailable is not None:
            return {"unavailable": self._unavailable}
        out: dict[str, Any] = {}
        for role, ids in self.gpus.items():
            out[role] = {gpu: self._one_gpu(gpu) for gpu in ids}
        return out

    def _one_gpu(self, gpu: str) -> dict[str, Any]:
        samples = self._samples.get(gpu, [])
        entry: dict[str, Any] = {"samples": len(samples)}
        if gpu in self._errors:
            entry["error"] = self._errors[gpu]
        if not samples:
            return entry
        sm, mem, power, util, bits = zip(*samples)
        counts: dict[str, int] = {}
        for b in bits:
            for name in reason_names(b):
                counts[name] = counts.get(name, 0) + 1
        entry.update(
            sm_mhz={"median": round(statistics.median(sm)), "min": min(sm), "max": max(sm),
                    "gpu_max": self._max_sm_mhz.get(gpu)},
            mem_mhz_median=round(statistics.median(mem)),
            power_w_median=round(statistics.median(power), 1),
            utilization_pct_median=round(statistics.median(util)),
            clock_event_reasons={name: round(n / len(samples), 3)
                                 for name, n in sorted(counts.items())})
        return entry


def one_line(gpu: dict[str, Any]) -> str:
    """The log line's part: each GPU's median SM clock (and its range), power and
    utilization, and the reasons seen in at least 5 % of its samples."""
    if "unavailable" in gpu:
        return f"not sampled: {gpu['unavailable']}"
    parts = []
    for role, by_gpu in gpu.items():
        for gpu_id, g in by_gpu.items():
            if not g.get("samples"):
                parts.append(f"{role} GPU {gpu_id}: no samples ({g.get('error', 'none taken')})")
                continue
            sm = g["sm_mhz"]
            reasons = [f"{name} {frac:.0%}" for name, frac in g["clock_event_reasons"].items()
                       if frac >= 0.05]
            parts.append(f"{role} GPU {gpu_id}: SM {sm['median']} MHz ({sm['min']}-{sm['max']}"
                         f" of {sm['gpu_max']}), {g['power_w_median']} W, "
                         f"{g['utilization_pct_median']} % busy"
                         + (f", {', '.join(reasons)}" if reasons else ""))
    return "; ".join(parts)
