"""kv_transfer_params parsing: valid prefill / decode / discovery requests, and every malformed
request gets a ParamsError whose message names the field to fix."""

from __future__ import annotations

import pytest

from vllm_layerkv.scheduler.request_params import (
    MAX_TRANSFER_ID_LEN,
    BootstrapAddress,
    DecodeParams,
    DiscoverParams,
    ParamsError,
    PrefillParams,
    parse,
)

DECODE = {"do_remote_prefill": True, "transfer_id": "abc", "remote_host": "10.0.0.5",
          "remote_port": 7000}


def test_plain_requests_are_none() -> None:
    assert parse(None) is None
    assert parse({}) is None
    assert parse({"do_remote_decode": False, "do_remote_prefill": False}) is None
    assert parse({"unrelated": 1}) is None


def test_prefill() -> None:
    assert parse({"do_remote_decode": True, "transfer_id": "t-1"}) == PrefillParams("t-1")
    # extra keys (NIXL-style fields a proxy may add) are tolerated
    assert parse({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t",
                  "remote_engine_id": "x"}) == PrefillParams("t")


def test_decode() -> None:
    assert parse(DECODE) == DecodeParams("abc", "10.0.0.5:7000")
    assert parse({**DECODE, "remote_port": "7001"}) == DecodeParams("abc", "10.0.0.5:7001")
    assert parse({**DECODE, "remote_port": 65535}).remote == "10.0.0.5:65535"
    assert parse({**DECODE, "remote_port": 1}).remote == "10.0.0.5:1"


def test_discover() -> None:
    assert parse({"layerkv_discover": True}) == DiscoverParams()
    assert parse({"layerkv_discover": False}) is None


def test_transfer_id_length_limit() -> None:
    tid = "x" * MAX_TRANSFER_ID_LEN
    assert parse({"do_remote_decode": True, "transfer_id": tid}) == PrefillParams(tid)
    with pytest.raises(ParamsError, match="transfer_id"):
        parse({"do_remote_decode": True, "transfer_id": tid + "x"})


@pytest.mark.parametrize("params", [[1, 2], "do_remote_decode", 5, ("a",)])
def test_non_dict_is_rejected(params: object) -> None:
    with pytest.raises(ParamsError) as e:
        parse(params)
    assert "kv_transfer_params must be a JSON object" in str(e.value)
    assert type(params).__name__ in str(e.value)


def test_both_flags() -> None:
    with pytest.raises(ParamsError) as e:
        parse({"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "t"})
    assert "do_remote_decode" in str(e.value) and "do_remote_prefill" in str(e.value)


@pytest.mark.parametrize("flag", ["do_remote_decode", "do_remote_prefill"])
@pytest.mark.parametrize("tid", [None, "", 17, ["t"]])
def test_bad_or_missing_transfer_id(flag: str, tid: object) -> None:
    if flag == "do_remote_decode" and tid is None:
        pytest.skip("a prefill request without a transfer_id is the sequential contract")
    params = {**DECODE, "do_remote_prefill": False, flag: True}
    if tid is None:
        params.pop("transfer_id")
    else:
        params["transfer_id"] = tid
    with pytest.raises(ParamsError) as e:
        parse(params)
    assert "kv_transfer_params.transfer_id" in str(e.value)


@pytest.mark.parametrize("host", [None, "", 10, ["h"]])
def test_bad_remote_host(host: object) -> None:
    params = dict(DECODE)
    if host is None:
        params.pop("remote_host")
    else:
        params["remote_host"] = host
    with pytest.raises(ParamsError) as e:
        parse(params)
    assert "kv_transfer_params.remote_host" in str(e.value)


@pytest.mark.parametrize("port", [None, 0, -1, 65536, "abc", "", "70000", 7000.0, True, [7000]])
def test_bad_remote_port(port: object) -> None:
    params = dict(DECODE)
    if port is None:
        params.pop("remote_port")
    else:
        params["remote_port"] = port
    with pytest.raises(ParamsError) as e:
        parse(params)
    assert "kv_transfer_params.remote_port" in str(e.value)
    assert "1-65535" in str(e.value)


def test_error_message_truncates_huge_values() -> None:
    with pytest.raises(ParamsError) as e:
        parse({"do_remote_decode": True, "transfer_id": "y" * 10_000})
    assert len(str(e.value)) < 400


def test_params_error_is_value_error() -> None:
    assert issubclass(ParamsError, ValueError)


def test_first_token_from_prefill() -> None:
    assert parse(DECODE).first_token_from_prefill is False
    assert parse({**DECODE, "first_token_from_prefill": True}) == DecodeParams(
        "abc", "10.0.0.5:7000", first_token_from_prefill=True)


@pytest.mark.parametrize("value", ["true", 1, None])
def test_first_token_from_prefill_must_be_a_bool(value: object) -> None:
    with pytest.raises(ParamsError, match="first_token_from_prefill must be true or false"):
        parse({**DECODE, "first_token_from_prefill": value})


@pytest.mark.parametrize("params", [
    {"do_remote_decode": True},
    # what vllm-router --kv-connector nixl and vLLM's toy proxy send to P
    {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
     "remote_block_ids": None, "remote_host": None, "remote_port": None},
])
def test_prefill_without_transfer_id_asks_for_one_to_be_minted(params: dict) -> None:
    assert parse(params) == PrefillParams(None, sequential=True)


def test_decode_through_the_bootstrap_endpoint() -> None:
    """What vllm-router --kv-connector mooncake and llm-d's mooncake sidecar send to D."""
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
              "remote_bootstrap_addr": "http://10.0.0.5:8998/", "remote_engine_id": "e0"}
    assert parse(params) == DecodeParams("xfer-1", BootstrapAddress("http://10.0.0.5:8998", "e0"))


@pytest.mark.parametrize("change,field", [
    ({"remote_bootstrap_addr": "10.0.0.5:8998"}, "remote_bootstrap_addr"),
    ({"remote_bootstrap_addr": 8998}, "remote_bootstrap_addr"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"remote_engine_id": None}, "remote_engine_id"),
])
def test_bad_bootstrap_fields_say_what_to_send(change: dict, field: str) -> None:
    params = {"do_remote_prefill": True, "transfer_id": "xfer-1",
              "remote_bootstrap_addr": "http://10.0.0.5:8998", "remote_engine_id": "e0",
              **change}
    with pytest.raises(ParamsError, match=f"kv_transfer_params.{field}"):
        parse(params)
