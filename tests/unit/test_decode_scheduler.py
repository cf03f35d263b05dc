"""decode_scheduler.py: the first-token step of a received request (``first_steps``), and its
tracing (``trace_path``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kv_sides import compat

from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.decode_scheduler import DecodeScheduler
from vllm_layerkv.metadata import LayerKVMetadata


def scheduled(*req_ids: str) -> SimpleNamespace:
    """The two fields of vLLM's SchedulerOutput the tracing reads."""
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in req_ids],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[]))


def test_first_step_is_marked_once(tmp_path: Path) -> None:
    d = DecodeScheduler(LayerKVConfig(trace_path=str(tmp_path / "trace")), compat(), 1, "d")
    try:
        d.finished_recving({"r1"})
        meta = LayerKVMetadata()
        d.build_meta(meta, scheduled("r1"))
        assert meta.first_steps == ["r1"]
        later = LayerKVMetadata()
        d.build_meta(later, scheduled("r1"))
        assert later.first_steps == []
        events = (tmp_path / "trace.dsched.0").read_text()
        assert '"recv_seen"' in events and '"d_scheduled"' in events
    finally:
        d.shutdown()


def test_request_aborted_before_its_first_step_is_forgotten(tmp_path: Path) -> None:
    d = DecodeScheduler(LayerKVConfig(trace_path=str(tmp_path / "trace")), compat(), 1, "d")
    try:
        d.finished_recving({"r1"})
        d.request_finished("r1")
        meta = LayerKVMetadata()
        d.build_meta(meta, scheduled("r1"))  # a reused id must not be taken for r1's step
        assert meta.first_steps == []
    finally:
        d.shutdown()


def test_first_steps_are_marked_without_tracing() -> None:
    """The worker needs them (a request reported early waits there for its KV), trace or no
    trace."""
    d = DecodeScheduler(LayerKVConfig(), compat(), 1, "d")
    try:
        d.finished_recving({"r1", "r2"})
        meta = LayerKVMetadata()
        d.build_meta(meta, scheduled("r2"))
        assert meta.first_steps == ["r2"]
        meta = LayerKVMetadata()
        d.build_meta(meta, scheduled("r1", "r2"))
        assert meta.first_steps == ["r1"]
    finally:
        d.shutdown()
