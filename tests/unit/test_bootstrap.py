"""scheduler/bootstrap.py: P's bootstrap endpoint over real HTTP, as a router and D use it."""

from __future__ import annotations

import json
import socket
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
from vllm_layerkv.wire.admission import ListenerLimits
from vllm_layerkv.wire.auth import ChannelAuth, parse_peers


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


# ------------------------------------------------------------------------ with a shared secret

SECRET = ChannelAuth(b"bootstrap-secret-0123456789abcdef")


@pytest.fixture
def signed_server() -> Iterator[BootstrapServer]:
    s = BootstrapServer("127.0.0.1", 0, dp_rank=0, engine_id="p-engine",
                        endpoint="127.0.0.1:7001", auth=SECRET)
    yield s
    s.close()


def test_register_needs_a_signature_when_a_secret_is_set(signed_server: BootstrapServer
                                                         ) -> None:
    url = f"http://127.0.0.1:{signed_server.port}/register"
    body = b'{"dp_rank": 1, "engine_id": "forged", "layerkv_endpoint": "10.9.9.9:1"}'
    status, answer = post(url, body)
    assert status == 401 and "no LayerKV signature" in answer["error"]  # type: ignore[index]
    register_with("127.0.0.1", signed_server.port, 1, "p-engine-dp1", "127.0.0.1:7002",
                  ChannelAuth(b"another-secret-0123456789abcdef"))
    register_with("127.0.0.1", signed_server.port, 2, "p-engine-dp2", "127.0.0.1:7003", SECRET)
    deadline = time.monotonic() + 10
    while "2" not in signed_server.entries() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert sorted(signed_server.entries()) == ["0", "2"]  # the wrong secret never got in


def test_query_stays_open_for_routers_and_d_signs_its_own(signed_server: BootstrapServer
                                                          ) -> None:
    addr = f"http://127.0.0.1:{signed_server.port}"
    assert get(addr + "/query")[0] == 200  # vllm-router and llm-d do not sign
    assert resolve(addr, "p-engine", timeout=5, auth=SECRET) == "127.0.0.1:7001"


def test_query_auth_requires_the_signature_on_query_too() -> None:
    s = BootstrapServer("127.0.0.1", 0, dp_rank=0, engine_id="p-engine",
                        endpoint="127.0.0.1:7001", auth=SECRET, query_auth=True)
    try:
        addr = f"http://127.0.0.1:{s.port}"
        status, answer = get(addr + "/query")
        assert status == 401 and "7001" not in json.dumps(answer)
        assert resolve(addr, "p-engine", timeout=5, auth=SECRET) == "127.0.0.1:7001"
        with pytest.raises(BootstrapError, match="HTTP 401: .*secrets differ"):
            resolve(addr, "p-engine", timeout=5,
                    auth=ChannelAuth(b"another-secret-0123456789abcdef"))
    finally:
        s.close()


def test_the_allowlist_and_the_connection_cap_apply() -> None:
    s = BootstrapServer("127.0.0.1", 0, dp_rank=0, engine_id="p-engine",
                        endpoint="127.0.0.1:7001",
                        auth=ChannelAuth(None, parse_peers("10.0.0.0/8")))
    try:
        with pytest.raises(BootstrapError, match="cannot query"):
            resolve(f"http://127.0.0.1:{s.port}", "p-engine", timeout=2)
    finally:
        s.close()
    s = BootstrapServer("127.0.0.1", 0, dp_rank=0, engine_id="p-engine",
                        endpoint="127.0.0.1:7001",
                        limits=ListenerLimits(max_connections=2, handshake_timeout_s=0.5))
    try:
        silent = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(20)]
        time.sleep(0.2)  # each new one closed the oldest that had not sent its request
        assert resolve(f"http://127.0.0.1:{s.port}", "p-engine", timeout=5) == "127.0.0.1:7001"
        for c in silent:
            c.close()
    finally:
        s.close()
