"""The server-log excerpt a failed e2e test's report carries."""

from __future__ import annotations

from pathlib import Path

from vllm_layerkv.testing.failure_logs import failure_report, notable_lines

START_UP = ("(APIServer pid=1) WARNING 11-28 10:21:27 [system_utils.py:255] Found ulimit of "
            "20000 and failed to automatically increase")
D_GAVE_UP = ("(EngineCore pid=2) ERROR 11-28 10:25:01 [decode.py:88] transfer abc: no KV "
             "after kv_wait_timeout_s=120 s")


def test_warnings_and_errors_are_kept_in_order_and_start_up_noise_is_left_out() -> None:
    lines = [START_UP, "INFO one", D_GAVE_UP, "Traceback (most recent call last):",
             "  File x", "RuntimeError: boom"] + [f"INFO {i}" for i in range(20)]
    picked = notable_lines(lines, max_notable=30, last=3)
    assert picked == [D_GAVE_UP, "Traceback (most recent call last):", "RuntimeError: boom",
                      "INFO 17", "INFO 18", "INFO 19"]


def test_only_the_last_notable_lines_are_kept() -> None:
    lines = [f"WARNING w{i}" for i in range(50)]
    assert notable_lines(lines, max_notable=5, last=0) == [f"WARNING w{i}" for i in range(45, 50)]


def test_report_names_each_log_of_each_folder_once(tmp_path: Path) -> None:
    (tmp_path / "decode.log").write_text(f"{START_UP}\n{D_GAVE_UP}\nINFO last\n")
    (tmp_path / "prefill.log").write_text("INFO only\n")
    (tmp_path / "trace.p.0").write_text("WARNING not a log\n")
    report = failure_report([tmp_path, tmp_path], last=1)
    assert report.count(f"--- {tmp_path / 'decode.log'}") == 1
    assert f"{D_GAVE_UP}\nINFO last" in report and "INFO only" in report
    assert "ulimit" not in report and "not a log" not in report
    assert failure_report([tmp_path / "nothing-here"]) == ""
