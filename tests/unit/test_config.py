"""LayerKVConfig: defaults, kv_connector_extra_config, LAYERKV_* environment variables,
validation errors that name the setting, and the documentation of every setting."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vllm_layerkv.config import (
    BOUNCE_NIXL_THREADS,
    ConfigError,
    LayerKVConfig,
    nixl_threads,
    pipeline_depth,
)

FIELDS = [f.name for f in dataclasses.fields(LayerKVConfig)]
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No LAYERKV_<setting> or VLLM_HOST_IP leaks in from the developer's shell."""
    for name in FIELDS:
        monkeypatch.delenv("LAYERKV_" + name.upper(), raising=False)
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    return monkeypatch


def test_defaults() -> None:
    for extra in (None, {}):
        c = LayerKVConfig.from_extra_config(extra)
        assert c.host == "127.0.0.1"
        assert (c.registration_port, c.data_port, c.transport) == (0, 0, "auto")
        assert c.layerwise is True
        assert (c.min_prompt_tokens, c.max_pipeline_stages, c.min_pipeline_stages) == (256, 8, 2)
        assert c.group_size == 0
        assert c.piecewise_cudagraph is False
        assert c.registration_wait_s == 0.5
        assert c.kv_wait_timeout_s == 120.0
        assert c.registration_timeout_s == 60.0
        assert c.ack_timeout_s == 60.0
        assert c.connect_timeout_s == 10.0
        assert c.io_timeout_s == 60.0
        assert c.trace_path == ""


def test_host_defaults_to_vllm_host_ip(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert LayerKVConfig.from_extra_config({}).host == "10.1.2.3"
    assert LayerKVConfig.from_extra_config({"host": "10.9.9.9"}).host == "10.9.9.9"


def test_extra_config_overrides_every_kind() -> None:
    c = LayerKVConfig.from_extra_config({
        "host": "0.0.0.0", "registration_port": 7000, "data_port": "7100", "transport": "tcp",
        "layerwise": False, "min_prompt_tokens": 64, "max_pipeline_stages": 6,
        "min_pipeline_stages": 3, "group_size": 4, "piecewise_cudagraph": "true",
        "registration_wait_s": 0, "kv_wait_timeout_s": "1.5", "registration_timeout_s": 2,
        "ack_timeout_s": 3.25, "connect_timeout_s": 0.5, "io_timeout_s": 7,
        "trace_path": "/tmp/t",
    })
    assert c.host == "0.0.0.0"
    assert c.registration_port == 7000 and isinstance(c.registration_port, int)
    assert c.data_port == 7100 and isinstance(c.data_port, int)  # string coerced
    assert c.transport == "tcp"
    assert c.layerwise is False and c.piecewise_cudagraph is True
    assert (c.min_prompt_tokens, c.max_pipeline_stages, c.min_pipeline_stages) == (64, 6, 3)
    assert c.group_size == 4
    assert c.registration_wait_s == 0.0 and isinstance(c.registration_wait_s, float)
    assert c.kv_wait_timeout_s == 1.5
    assert c.registration_timeout_s == 2.0 and isinstance(c.registration_timeout_s, float)
    assert c.ack_timeout_s == 3.25 and c.connect_timeout_s == 0.5 and c.io_timeout_s == 7.0
    assert c.trace_path == "/tmp/t"


def test_integral_float_is_accepted_for_int_setting() -> None:
    assert LayerKVConfig.from_extra_config({"group_size": 3.0}).group_size == 3


def test_env_vars_apply_and_extra_config_wins(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LAYERKV_KV_WAIT_TIMEOUT_S", "5")
    clean_env.setenv("LAYERKV_LAYERWISE", "off")
    clean_env.setenv("LAYERKV_GROUP_SIZE", "2")
    clean_env.setenv("LAYERKV_TRANSPORT", "tcp")
    c = LayerKVConfig.from_extra_config({"group_size": 5})
    assert c.kv_wait_timeout_s == 5.0
    assert c.layerwise is False
    assert c.transport == "tcp"
    assert c.group_size == 5  # extra_config beats LAYERKV_GROUP_SIZE


def test_env_var_that_is_overridden_is_not_even_parsed(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LAYERKV_DATA_PORT", "not-a-port")
    assert LayerKVConfig.from_extra_config({"data_port": 9000}).data_port == 9000
    with pytest.raises(ConfigError, match="LAYERKV_DATA_PORT"):
        LayerKVConfig.from_extra_config({})


def test_unrelated_layerkv_env_vars_are_ignored(clean_env: pytest.MonkeyPatch) -> None:
    # e.g. LAYERKV_MODELS_DIR belongs to the test-model tooling, not to the connector
    clean_env.setenv("LAYERKV_MODELS_DIR", "/nowhere")
    clean_env.setenv("LAYERKV_NOT_A_SETTING", "1")
    assert LayerKVConfig.from_extra_config({}) == LayerKVConfig.from_extra_config(None)


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), (True, True),
    ("0", False), ("false", False), ("No", False), ("off", False), (False, False),
])
def test_bool_strings(value: object, expected: bool) -> None:
    assert LayerKVConfig.from_extra_config({"layerwise": value}).layerwise is expected


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as e:
        LayerKVConfig.from_extra_config({"kv_wait_timeout": 3, "layerwise": True})
    msg = str(e.value)
    assert "kv_wait_timeout" in msg
    for name in FIELDS:  # every valid setting is listed so the user can spot the typo
        assert repr(name) in msg
    assert "docs/configuration.md" in msg


@pytest.mark.parametrize("key,value", [
    ("layerwise", "maybe"),
    ("layerwise", 1),                 # JSON number is not a boolean
    ("piecewise_cudagraph", "enabled"),
    ("registration_port", "80a"),
    ("registration_port", 1.5),
    ("group_size", True),             # bool is not an int here
    ("min_prompt_tokens", None),
    ("kv_wait_timeout_s", "soon"),
    ("ack_timeout_s", False),
    ("host", 127),
    ("trace_path", ["a"]),
])
def test_bad_types_name_the_setting(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        LayerKVConfig.from_extra_config({key: value})
    msg = str(e.value)
    assert key in msg
    assert "kv_connector_extra_config" in msg  # where the value came from


def test_bad_env_value_names_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LAYERKV_IO_TIMEOUT_S", "ten")
    with pytest.raises(ConfigError, match=r"io_timeout_s.*LAYERKV_IO_TIMEOUT_S"):
        LayerKVConfig.from_extra_config({})


@pytest.mark.parametrize("key", ["kv_wait_timeout_s", "registration_timeout_s", "ack_timeout_s",
                                 "connect_timeout_s", "io_timeout_s"])
@pytest.mark.parametrize("value", [0, -1, -0.5])
def test_timeouts_must_be_positive(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        LayerKVConfig.from_extra_config({key: value})


def test_registration_wait_may_be_zero_but_not_negative() -> None:
    assert LayerKVConfig.from_extra_config({"registration_wait_s": 0}).registration_wait_s == 0
    with pytest.raises(ConfigError, match="registration_wait_s"):
        LayerKVConfig.from_extra_config({"registration_wait_s": -0.1})


@pytest.mark.parametrize("key", ["registration_port", "data_port"])
@pytest.mark.parametrize("value", [-1, 65536, 100000])
def test_ports_out_of_range(key: str, value: int) -> None:
    with pytest.raises(ConfigError, match=re.escape(key) + f"={value}"):
        LayerKVConfig.from_extra_config({key: value})


@pytest.mark.parametrize("key", ["registration_port", "data_port"])
def test_port_bounds_are_valid(key: str) -> None:
    assert getattr(LayerKVConfig.from_extra_config({key: 65535}), key) == 65535
    assert getattr(LayerKVConfig.from_extra_config({key: 0}), key) == 0


def test_min_stages_above_max_stages() -> None:
    with pytest.raises(ConfigError) as e:
        LayerKVConfig.from_extra_config({"min_pipeline_stages": 5, "max_pipeline_stages": 4})
    assert "max_pipeline_stages=4" in str(e.value) and "min_pipeline_stages=5" in str(e.value)
    c = LayerKVConfig.from_extra_config({"min_pipeline_stages": 4, "max_pipeline_stages": 4})
    assert c.min_pipeline_stages == c.max_pipeline_stages == 4


@pytest.mark.parametrize("extra,name", [
    ({"min_pipeline_stages": 0}, "min_pipeline_stages"),
    ({"group_size": -1}, "group_size"),
    ({"min_prompt_tokens": -1}, "min_prompt_tokens"),
    ({"transport": "rdma"}, "transport"),
    ({"host": ""}, "host"),
    ({"staging_buffers": -1}, "staging_buffers"),
    ({"staging_buffers": 65}, "staging_buffers"),
    ({"recv_ring_slots": 65}, "recv_ring_slots"),
    ({"writes_in_flight": -1}, "writes_in_flight"),
    ({"writes_in_flight": 65}, "writes_in_flight"),
    ({"gil_switch_interval_ms": -1}, "gil_switch_interval_ms"),
    ({"gil_switch_interval_ms": 101}, "gil_switch_interval_ms"),
    ({"gil_switch_interval_ms": float("nan")}, "gil_switch_interval_ms"),
])
def test_bad_values_name_the_setting(extra: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(name)):
        LayerKVConfig.from_extra_config(extra)


def test_transport_error_lists_the_choices() -> None:
    with pytest.raises(ConfigError) as e:
        LayerKVConfig.from_extra_config({"transport": "rdma"})
    for choice in ("auto", "tcp", "cuda_ipc", "nixl", "mooncake"):
        assert f"'{choice}'" in str(e.value)


@pytest.mark.parametrize("extra, name", [
    ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
    ({"nixl_backends": ""}, "nixl_backends"),
    ({"nixl_backends": "UCX,,"}, "nixl_backends"),
    ({"nixl_num_threads": -2}, "nixl_num_threads"),
])
def test_bad_engine_settings_name_the_setting(extra: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        LayerKVConfig.from_extra_config(extra)


def test_the_pipeline_defaults_follow_host_bounce() -> None:
    """Unset (the defaults), NIXL's threads and the staging pipeline depend on whether layer
    groups go through host memory; a value set is kept as it is."""
    c = LayerKVConfig()
    assert (c.nixl_num_threads, c.staging_buffers, c.writes_in_flight) == (-1, 0, 0)
    assert nixl_threads(c.nixl_num_threads, host_bounce=True) == BOUNCE_NIXL_THREADS == 4
    assert nixl_threads(c.nixl_num_threads, host_bounce=False) == 0
    assert pipeline_depth(c.staging_buffers, host_bounce=True) == 4
    assert pipeline_depth(c.writes_in_flight, host_bounce=False) == 2
    set_ = LayerKVConfig.from_extra_config({"nixl_num_threads": 0, "writes_in_flight": 1})
    assert nixl_threads(set_.nixl_num_threads, host_bounce=True) == 0
    assert pipeline_depth(set_.writes_in_flight, host_bounce=True) == 1


def test_config_error_is_a_value_error() -> None:
    # vLLM's config parsing reports ValueErrors to the user as configuration mistakes
    assert issubclass(ConfigError, ValueError)


def test_replace_keeps_other_settings_and_is_frozen() -> None:
    c = LayerKVConfig.from_extra_config({"group_size": 2})
    d = c.replace(kv_wait_timeout_s=1.0)
    assert d.group_size == 2 and d.kv_wait_timeout_s == 1.0 and c.kv_wait_timeout_s == 120.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.group_size = 3  # type: ignore[misc]


def test_every_setting_is_documented() -> None:
    text = DOC.read_text()
    missing = [name for name in FIELDS if f"`{name}`" not in text]
    assert not missing, f"settings missing from docs/configuration.md: {missing}"


def test_idle_backoff_resolves_by_device_and_refuses_other_values() -> None:
    auto = LayerKVConfig.from_extra_config({})
    assert auto.backs_off_when_idle("cpu") and not auto.backs_off_when_idle("cuda")
    on = LayerKVConfig.from_extra_config({"idle_backoff": "on"})
    off = LayerKVConfig.from_extra_config({"idle_backoff": "off"})
    assert on.backs_off_when_idle("cuda") and not off.backs_off_when_idle("cpu")
    with pytest.raises(ConfigError, match="idle_backoff='sometimes': use auto, on or off"):
        LayerKVConfig.from_extra_config({"idle_backoff": "sometimes"})
