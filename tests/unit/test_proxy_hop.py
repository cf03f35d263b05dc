"""benchmarks/proxy_hop.py: the proxy's hop against fake backends, run end to end with few
requests (real proxy processes on each event loop, both flows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "proxy_hop.py"


def test_every_row_is_measured_through_a_real_proxy(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    out = tmp_path / "hop.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "20", "--warmup", "3",
                           "--rounds", "1", "--prompt-tokens", "64", "--out", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"direct", "proxy-asyncio", "proxy-ft-asyncio", "proxy-uvloop",
                         "proxy-ft-uvloop"}
    assert rows["direct"]["hop_ms"] == 0.0
    for name, row in rows.items():
        assert 0 < row["median_ms"] <= row["p90_ms"] < 5000, (name, row)
        # a proxied request is a client request plus the proxy's two upstream ones
        if name != "direct":
            assert row["median_ms"] > rows["direct"]["median_ms"], (name, row)
    assert "proxy-uvloop" in done.stdout and "--prompt-tokens 64" in result["command"]


def test_bad_counts_are_refused() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--requests" in done.stderr
