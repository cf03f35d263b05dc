"""benchmarks/profile_trace.py: the TTFT breakdown from P, D, scheduler and proxy traces, on
hand-written traces with known times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_scripts import load

profile_trace = load("profile_trace")

TID = "t1"
REQ = "cmpl-t1-0"


def write(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def traces(tmp_path: Path, schedulers: bool) -> Path:
    """One request, 4,096 tokens in one chunk of two layer groups; times in seconds."""
    write(tmp_path / "trace.proxy.0", [
        {"ev": "proxy_in", "transfer_id": TID, "t": 10.000},
        {"ev": "proxy_d_first", "transfer_id": TID, "t": 10.150},
        {"ev": "proxy_out", "transfer_id": TID, "t": 10.200},
    ])
    write(tmp_path / "trace.p.0", [
        {"ev": "step_plan", "step": 3, "groups": 2, "tokens": 4096, "tasks": 1,
         "transfer_ids": [TID], "final": [TID], "t": 10.020},
        {"ev": "group_send_start", "step": 3, "group": 0, "layers": 16, "t": 10.060},
        {"ev": "group_send_end", "step": 3, "group": 0, "seconds": 0.002, "t": 10.062},
        {"ev": "group_send_start", "step": 3, "group": 1, "layers": 16, "t": 10.100},
        {"ev": "group_send_end", "step": 3, "group": 1, "seconds": 0.003, "t": 10.103},
        {"ev": "transfer_done_sent", "transfer_id": TID, "t": 10.1035},
    ])
    write(tmp_path / "trace.d.0", [
        {"ev": "recv_expected", "transfer_id": TID, "t": 10.012},
        {"ev": "recv_closed", "transfer_id": TID, "req_id": REQ, "outcome": "ok",
         "nbytes": 1 << 29, "t": 10.104},
        {"ev": "recv_reported", "req_ids": [REQ], "t": 10.105},
        {"ev": "d_step_bound", "req_ids": [REQ], "t": 10.112},
        {"ev": "d_step_launched", "req_ids": [REQ], "t": 10.114},
    ])
    if schedulers:
        write(tmp_path / "trace.psched.0", [
            {"ev": "p_seen", "transfer_id": TID, "t": 10.010},
            {"ev": "reg_arrived", "transfer_id": TID, "t": 10.013},
            {"ev": "p_admitted", "transfer_id": TID, "t": 10.015},
        ])
        write(tmp_path / "trace.dsched.0", [
            {"ev": "d_registering", "transfer_id": TID, "t": 10.011},
            {"ev": "recv_seen", "req_ids": [REQ], "t": 10.107},
            {"ev": "d_scheduled", "req_ids": [REQ], "t": 10.109},
        ])
    return tmp_path


def test_segments_and_parts_add_up(tmp_path: Path) -> None:
    [row] = profile_trace.request_breakdowns(traces(tmp_path, schedulers=True))
    expected = {"start_delay": 20.0, "prefill": 80.0, "last_copy": 3.0, "done_msg": 1.0,
                "report": 1.0, "d_first": 45.0, "total": 150.0,
                "p_intake": 10.0, "reg_wait": 5.0, "p_plan": 5.0,
                "reg_from_d": 1.0, "reg_in": 2.0, "reg_pickup": 2.0,
                "d_seen": 2.0, "d_sched": 2.0, "d_bind": 3.0, "d_forward": 2.0, "d_out": 36.0}
    for key, ms in expected.items():
        assert row[key] == pytest.approx(ms, abs=0.01), key
    assert row["prompt_tokens_computed"] == 4096 and row["chunks"] == 1
    medians = profile_trace.medians_by_length([row])
    table = profile_trace.format_table(medians)
    assert "reg_wait" in table and "d_out" in table


def test_last_copy_ends_when_the_last_ring_write_landed(tmp_path: Path) -> None:
    """Ring writes stay in flight after their group is posted (10.103): the last one landed at
    10.1033, so last_copy runs to it and done_msg from it."""
    traces(tmp_path, schedulers=False)
    p = tmp_path / "trace.p.0"
    events = [json.loads(line) for line in p.read_text().splitlines()]
    events.insert(-1, {"ev": "piece_landed", "transfer_id": TID, "nbytes": 1 << 25,
                       "waited": 0.001, "seconds": 0.004, "t": 10.1033})
    events.insert(2, {"ev": "piece_landed", "transfer_id": "other", "nbytes": 1 << 25,
                      "waited": 0.0, "seconds": 0.004, "t": 10.1034})
    write(p, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert row["last_copy"] == pytest.approx(3.3, abs=0.01)
    assert row["done_msg"] == pytest.approx(0.7, abs=0.01)
    assert row["total"] == pytest.approx(150.0, abs=0.01)


def test_a_registration_sent_before_p_saw_the_request_counts_only_the_pickup(
        tmp_path: Path) -> None:
    """D registered (10.008) and P's thread read it (10.009) before P's scheduler saw the
    request (10.010): P's whole wait (5 ms) is the pickup."""
    traces(tmp_path, schedulers=True)
    psched = tmp_path / "trace.psched.0"
    events = [json.loads(line) for line in psched.read_text().splitlines()]
    for e in events:
        if e["ev"] == "reg_arrived":
            e["t"] = 10.009
    write(psched, events)
    dsched = tmp_path / "trace.dsched.0"
    events = [json.loads(line) for line in dsched.read_text().splitlines()]
    events[0]["t"] = 10.008
    write(dsched, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert (row["reg_from_d"], row["reg_in"]) == (0, 0)
    assert row["reg_pickup"] == pytest.approx(row["reg_wait"], abs=0.01)
    assert "reg_pickup" in profile_trace.format_table(profile_trace.medians_by_length([row]))


def test_the_first_token_from_p_is_timed_from_p_s_last_group_to_the_proxy(
        tmp_path: Path) -> None:
    """``--first-token-from-prefill``: P's token reached the proxy at 10.109, 9 ms after the
    sender saw P's last group done (10.100), 109 ms after the request came in."""
    traces(tmp_path, schedulers=True)
    proxy = tmp_path / "trace.proxy.0"
    events = [json.loads(line) for line in proxy.read_text().splitlines()]
    events.insert(1, {"ev": "proxy_p_token", "transfer_id": TID, "t": 10.109})
    write(proxy, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert row["p_answer"] == pytest.approx(9.0, abs=0.01)
    assert row["ft_total"] == pytest.approx(109.0, abs=0.01)
    table = profile_trace.format_table(profile_trace.medians_by_length([row]))
    assert "p_answer" in table and "ft_total" in table and "p_frontend" not in table
    # P's scheduler had the finished request at 10.102: 2 ms to the engine, 7 ms after it
    with (tmp_path / "trace.psched.0").open("a") as f:
        f.write(json.dumps({"ev": "p_finished", "transfer_id": TID, "t": 10.102}) + "\n")
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert row["p_to_engine"] == pytest.approx(2.0, abs=0.01)
    assert row["p_frontend"] == pytest.approx(7.0, abs=0.01)
    assert "p_frontend" in profile_trace.format_table(profile_trace.medians_by_length([row]))
    default_flow = tmp_path / "default_flow"
    default_flow.mkdir()
    [plain] = profile_trace.request_breakdowns(traces(default_flow, schedulers=True))
    assert "p_answer" not in plain


def test_intake_marks_split_each_side_s_way_to_its_scheduler(tmp_path: Path) -> None:
    """P's API server made the request 4 ms after the proxy had it, its engine core queued it
    1 ms later and its scheduler saw it 5 ms after that (p_seen, 10.010); D's 6 + 1 + 2 ms to
    d_seen (10.009), and 2 ms more to its registration (10.011)."""
    traces(tmp_path, schedulers=True)
    psched = tmp_path / "trace.psched.0"
    events = [json.loads(line) for line in psched.read_text().splitlines()]
    events[0].update(arrival=10.004, queued=10.005)
    write(psched, events)
    dsched = tmp_path / "trace.dsched.0"
    events = [json.loads(line) for line in dsched.read_text().splitlines()]
    events.insert(0, {"ev": "d_seen", "transfer_id": TID, "arrival": 10.006, "queued": 10.007,
                      "t": 10.009})
    write(dsched, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    expected = {"p_api": 4.0, "p_core": 1.0, "p_pick": 5.0,
                "d_api": 6.0, "d_core": 1.0, "d_pick": 2.0, "d_alloc": 2.0}
    for key, ms in expected.items():
        assert row[key] == pytest.approx(ms, abs=0.01), key
    assert row["p_api"] + row["p_core"] + row["p_pick"] == pytest.approx(row["p_intake"])
    table = profile_trace.format_table(profile_trace.medians_by_length([row]))
    assert "d_alloc" in table
    # vLLM without log stats records no QUEUED event: no intake parts, the rest unchanged
    events[0].pop("queued")
    write(dsched, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert "p_api" in row and not any(k in row for k in ("d_api", "d_pick", "d_alloc"))
    assert "p_api" not in profile_trace.format_table(profile_trace.medians_by_length([row]))


def test_without_scheduler_traces_only_the_segments(tmp_path: Path) -> None:
    """Traces from before the schedulers traced (or a D rank without them): no parts, and the
    table keeps its old columns."""
    [row] = profile_trace.request_breakdowns(traces(tmp_path, schedulers=False))
    assert row["d_first"] == pytest.approx(45.0, abs=0.01)
    assert not any(k in row for k in (*profile_trace.P_PARTS, *profile_trace.REG_PARTS,
                                      *profile_trace.INTAKE_PARTS, *profile_trace.D_PARTS))
    table = profile_trace.format_table(profile_trace.medians_by_length([row]))
    assert "d_first" in table and "reg_wait" not in table and "d_seen" not in table


def test_early_release_counts_d_parts_from_the_close(tmp_path: Path) -> None:
    """D reported the request (and vLLM saw and scheduled it) while P's last group was still
    being sent: report = 0, the parts vLLM got through before the close are 0, and the parts
    still add up to d_first."""
    traces(tmp_path, schedulers=True)
    d = [json.loads(line) for line in (tmp_path / "trace.d.0").read_text().splitlines()]
    for e in d:
        if e["ev"] == "recv_reported":
            e["t"] = 10.095  # before recv_closed (10.104)
        if e["ev"] == "d_step_bound":
            e["t"] = 10.105  # bind waited for the close
    write(tmp_path / "trace.d.0", d)
    write(tmp_path / "trace.dsched.0", [
        {"ev": "recv_seen", "req_ids": [REQ], "t": 10.097},
        {"ev": "d_scheduled", "req_ids": [REQ], "t": 10.099},
    ])
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert row["early"] is True
    assert row["report"] == 0 and row["d_seen"] == 0 and row["d_sched"] == 0
    assert row["d_bind"] == pytest.approx(1.0, abs=0.01)
    assert row["d_first"] == pytest.approx(46.0, abs=0.01)
    parts = sum(row[k] for k in profile_trace.D_PARTS)
    assert parts == pytest.approx(row["d_first"], abs=0.02)


def test_device_ready_times_split_prefill_into_compute_and_send_wait(tmp_path: Path) -> None:
    """On GPU the last group was ready on the device 55 ms after the plan, while the sender got
    to it 80 ms after (still sending the group before it): p_gpu 55, send_wait 25."""
    traces(tmp_path, schedulers=False)
    p = tmp_path / "trace.p.0"
    events = [json.loads(line) for line in p.read_text().splitlines()]
    events.insert(1, {"ev": "group_ready", "step": 3, "group": 0, "gpu_s": 0.030, "t": 10.060})
    events.insert(4, {"ev": "group_ready", "step": 3, "group": 1, "gpu_s": 0.055, "t": 10.100})
    write(p, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert row["prefill"] == pytest.approx(80.0, abs=0.01)
    assert row["p_gpu"] == pytest.approx(55.0, abs=0.01)
    assert row["send_wait"] == pytest.approx(25.0, abs=0.01)
    table = profile_trace.format_table(profile_trace.medians_by_length([row]))
    assert "p_gpu | send_wait" in table


def test_a_chunked_prompt_adds_up_the_device_time_of_its_steps(tmp_path: Path) -> None:
    """Two chunks, 30 and 45 ms on the device: p_gpu 75 ms, whatever the plans' wall times."""
    traces(tmp_path, schedulers=False)
    p = tmp_path / "trace.p.0"
    events = [json.loads(line) for line in p.read_text().splitlines()]
    first = {"ev": "step_plan", "step": 2, "groups": 2, "tokens": 4096, "tasks": 1,
             "transfer_ids": [TID], "final": [], "t": 9.990}
    events[:0] = [first,
                  {"ev": "group_ready", "step": 2, "group": 1, "gpu_s": 0.030, "t": 10.021}]
    events.append({"ev": "group_ready", "step": 3, "group": 1, "gpu_s": 0.045, "t": 10.100})
    write(p, events)
    [row] = profile_trace.request_breakdowns(tmp_path)
    assert row["chunks"] == 2 and row["prefill"] == pytest.approx(110.0, abs=0.01)
    assert row["p_gpu"] == pytest.approx(75.0, abs=0.01)
    assert row["send_wait"] == pytest.approx(35.0, abs=0.01)
