"""scheduler/bootstrap.py: P's bootstrap endpoint over real HTTP, as a router and D use it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from vllm_layerkv.scheduler.bootstrap import (
    BootstrapError,
    BootstrapServer,
    register_with,
    resolve,
)


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0, dp_rank=0, engine_id="p-engine",
                        endpoint="127.0.0.1:7001")
    yield s
    s.close()


def get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: bytes) -> tuple[int, object]:
    req = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_query_answers_in_vllm_mooncake_shape(server: BootstrapServer) -> None:
    """What vllm-router and llm-d read: dp_rank keys (as strings) -> engine_id, worker_addr."""
    status, body = get(f"http://127.0.0.1:{server.port}/query")
    assert status == 200
    assert body == {"0": {"engine_id": "p-engine", "worker_addr": {"0": {"0": "127.0.0.1:7001"}},
                          "layerkv_endpoint": "127.0.0.1:7001"}}
    assert get(f"http://127.0.0.1:{server.port}/other")[0] == 404


def test_decode_resolves_the_engine_named_by_the_router(server: BootstrapServer) -> None:
    addr = f"http://127.0.0.1:{server.port}"
    assert resolve(addr, "p-engine", timeout=5) == "127.0.0.1:7001"
    assert resolve(addr + "/", "p-engine", timeout=5) == "127.0.0.1:7001"
    with pytest.raises(BootstrapError, match="knows no prefill engine 'other'.*p-engine"):
        resolve(addr, "other", timeout=5)


def test_other_data_parallel_ranks_register_with_rank_0(server: BootstrapServer) -> None:
    register_with("127.0.0.1", server.port, 1, "p-engine-dp1", "127.0.0.1:7002")
    deadline = time.monotonic() + 10
    while "1" not in server.entries() and time.monotonic() < deadline:
        time.sleep(0.02)
    addr = f"http://127.0.0.1:{server.port}"
    assert resolve(addr, "p-engine-dp1", timeout=5) == "127.0.0.1:7002"
    assert resolve(addr, "p-engine", timeout=5) == "127.0.0.1:7001"


@pytest.mark.parametrize("body", [b"{}", b"not json", b'{"dp_rank": -1, "engine_id": "e", '
                                  b'"layerkv_endpoint": "h:1"}', b"x" * 5000])
def test_bad_registrations_are_refused(server: BootstrapServer, body: bytes) -> None:
    status, answer = post(f"http://127.0.0.1:{server.port}/register", body)
    assert status == 400 and "bad registration" in answer["error"]  # type: ignore[index]
    assert list(server.entries()) == ["0"]


def test_an_entry_without_layerkv_endpoint_is_not_layerkv(server: BootstrapServer) -> None:
    """vLLM's own MooncakeConnector answers engine_id and worker_addr only."""
    server.add(0, "p-engine", "127.0.0.1:7001")
    server._entries["0"].pop("layerkv_endpoint")
    with pytest.raises(BootstrapError, match="not a LayerKV instance"):
        resolve(f"http://127.0.0.1:{server.port}", "p-engine", timeout=5)


def test_unreachable_bootstrap_says_where(server: BootstrapServer) -> None:
    port = server.port
    server.close()
    with pytest.raises(BootstrapError, match=f"cannot query .*127.0.0.1:{port}/query"):
        resolve(f"http://127.0.0.1:{port}", "p-engine", timeout=2)


def test_a_port_in_use_says_what_to_change(server: BootstrapServer) -> None:
    with pytest.raises(BootstrapError, match="bootstrap_port"):
        BootstrapServer("127.0.0.1", server.port, 0, "e", "h:1")
