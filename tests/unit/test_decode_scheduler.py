"""scheduler/decode.py: the first-token step of a received request (``first_steps``), its
tracing (``trace_path``), and continuing from P's first token (``first_token_from_prefill``)."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from types import SimpleNamespace

from kv_sides import compat
from vllm_objects import create_request

from vllm_layerkv.config import LayerKVConfig
from vllm_layerkv.metadata import LayerKVMetadata
from vllm_layerkv.scheduler.decode import DecodeScheduler
from vllm_layerkv.scheduler.registrar import RegistrationServer
from vllm_layerkv.scheduler.request_params import DecodeParams
from vllm_layerkv.wire.protocol import Cancel, FirstToken, Register, RegisterAck


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


# ------------------------------------------------------------ first_token_from_prefill


class _Blocks:
    def __init__(self, *groups: list[int]) -> None:
        self._groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self._groups


def _prefill_stub() -> tuple[RegistrationServer, queue.SimpleQueue]:
    """A real registration server that records what D sends and accepts every Register."""
    got: queue.SimpleQueue = queue.SimpleQueue()

    def on_register(reg: Register) -> RegisterAck:
        got.put(reg)
        return RegisterAck(transfer_id=reg.transfer_id, tp_size=1)

    return RegistrationServer("127.0.0.1", 0, on_register, got.put), got


def _build_until(d: DecodeScheduler, cond, timeout: float = 5.0) -> LayerKVMetadata:
    """build_meta until the metadata satisfies ``cond`` (answers come from another thread)."""
    deadline = time.monotonic() + timeout
    while True:
        meta = LayerKVMetadata()
        d.build_meta(meta)
        if cond(meta):
            return meta
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_first_token_is_asked_for_passed_to_the_workers_and_appended() -> None:
    server, got = _prefill_stub()
    d = DecodeScheduler(LayerKVConfig(), compat(), 1, "d")
    try:
        d.set_data_endpoints(["127.0.0.1:1"])
        request = create_request(40, None, max_tokens=4)
        prompt = list(request.prompt_token_ids)
        d.after_alloc(request, _Blocks([3, 4, 5]), 40,
                      DecodeParams("ft", server.endpoint, first_token_from_prefill=True))
        meta = LayerKVMetadata()
        d.build_meta(meta)
        assert meta.recvs[0].wants_first_token
        reg = got.get(timeout=5)
        assert reg.wants_first_token and reg.transfer_id == "ft"
        server.push(FirstToken(transfer_id="unknown", token_id=5))  # nobody asked: dropped
        server.push(FirstToken(transfer_id="ft", token_id=777))
        meta = _build_until(d, lambda m: m.first_tokens)
        assert meta.first_tokens == ["ft"]
        assert request.prompt_token_ids == prompt  # appended only when vLLM readies it
        d.finished_recving({request.request_id})
        assert request.prompt_token_ids == prompt + [777]
        assert list(request.all_token_ids) == prompt + [777]
        assert request.num_prompt_tokens == 41 and request.num_tokens == 41
    finally:
        d.shutdown()
        server.close()


def test_first_token_from_prefill_is_refused_for_models_with_mamba_state() -> None:
    """P computes a Mamba hybrid's prompt minus its last token(s), so its token is not the
    first: D fails such a request at once, saying what to change, and cancels it at P."""
    server, got = _prefill_stub()
    d = DecodeScheduler(LayerKVConfig(), compat(), 1, "d", backoff=1)
    try:
        d.set_data_endpoints(["127.0.0.1:1"])
        d.after_alloc(create_request(40, None), _Blocks([1, 2, 3]), 39,
                      DecodeParams("hy", server.endpoint, first_token_from_prefill=True))
        meta = LayerKVMetadata()
        d.build_meta(meta)
        (close,) = meta.recv_closes
        assert close.failed and close.transfer_id == "hy"
        assert "Mamba" in close.reason and "--first-token-from-prefill" in close.reason
        cancel = got.get(timeout=5)
        assert isinstance(cancel, Cancel) and cancel.transfer_id == "hy"
        assert got.empty()  # never registered
    finally:
        d.shutdown()
        server.close()
