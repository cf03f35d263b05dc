"""Connector statistics: collected by workers, aggregated by vLLM, logged and exported.

Workers fill a ``WorkerStats`` (``counters.py``) from several threads; each engine step the
connector hands vLLM a ``LayerKVStats`` snapshot (``get_kv_connector_stats``). vLLM sums them
across workers, logs ``reduce()`` periodically ("KV Transfer metrics: ...") and feeds
``LayerKVPromMetrics`` for ``/metrics``.

Exposed transfer time is the one number that matters for TTFT: from the end of the prefill's
last forward step (its last layer ran) to the moment the last byte of that request was handed to
the transport. Layer-group streaming exists to make it small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_layerkv.compat import KVConnectorPromMetrics, KVConnectorStats, create_metric_per_engine
from vllm_layerkv.counters import add_counts, empty_counts, nothing_counted

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT


class LayerKVStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty_counts()

    def reset(self) -> None:
        self.data = empty_counts()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        add_counts(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "bytes sent": self.data["bytes_sent"],
            "bytes received": self.data["bytes_received"],
            "groups sent": self.data["groups_sent"],
            "transfers sent": self.data["transfers_sent"],
            "transfers received": self.data["transfers_received"],
            "failed": self.data["transfers_failed"],
        }
        if self.data.get("remote_prefill_fallbacks"):
            out["remote prefill fallbacks"] = self.data["remote_prefill_fallbacks"]
        send = self.data["send_seconds"]
        if send:
            out["avg group send (ms)"] = round(1e3 * sum(send) / len(send), 3)
            total = sum(send)
            if total > 0:
                out["send throughput (MiB/s)"] = round(self.data["bytes_sent"] / total / 2**20, 1)
        exposed = self.data["exposed_seconds"]
        if exposed:
            out["avg exposed transfer (ms)"] = round(1e3 * sum(exposed) / len(exposed), 3)
            out["max exposed transfer (ms)"] = round(1e3 * max(exposed), 3)
        return out

    def is_empty(self) -> bool:
        return nothing_counted(self.data)


class LayerKVPromMetrics(KVConnectorPromMetrics):
    """``/metrics``: vllm:layerkv_* counters and histograms, one series per engine."""

    def __init__(self, vllm_config: VllmConfig,
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        time_buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0]

        def counter(name: str, doc: str) -> dict[int, PromMetric]:
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)

        def histogram(name: str, doc: str) -> dict[int, PromMetric]:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=time_buckets,
                                    labelnames=labelnames),
                per_engine_labelvalues)

        self._counters = {
            "bytes_sent": counter("vllm:layerkv_bytes_sent", "KV bytes pushed to decode"),
            "bytes_received": counter("vllm:layerkv_bytes_received",
                                      "KV bytes received from prefill"),
            "groups_sent": counter("vllm:layerkv_groups_sent", "Layer-group transfers sent"),
            "transfers_sent": counter("vllm:layerkv_transfers_sent",
                                      "Requests whose KV was fully sent"),
            "transfers_received": counter("vllm:layerkv_transfers_received",
                                          "Requests whose KV fully arrived"),
            "transfers_failed": counter("vllm:layerkv_transfers_failed",
                                        "Transfers that failed or were aborted"),
            "remote_prefill_fallbacks": counter(
                "vllm:layerkv_remote_prefill_fallbacks",
                "Requests that asked for a remote prefill LayerKV could not serve (computed "
                "locally or failed, per remote_prefill_fallback)"),
        }
        self._histograms = {
            "send_seconds": histogram("vllm:layerkv_group_send_seconds",
                                      "Time to send one layer group"),
            "exposed_seconds": histogram(
                "vllm:layerkv_exposed_transfer_seconds",
                "Transfer time left after the prefill's last layer ran (TTFT cost)"),
            "recv_seconds": histogram("vllm:layerkv_receive_seconds",
                                      "Decode wait from registration to all KV arrived"),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        for key, metric in self._histograms.items():
            for value in transfer_stats_data.get(key, []):
                metric[engine_idx].observe(value)
