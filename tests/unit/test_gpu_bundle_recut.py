"""scripts/gpu_bundle_recut.sh: the GPU bundle's parts, re-cut into pieces that each travel
beside the tracked tree within one device call's carry limit, come back byte for byte in
$HOME/stage once every piece has been staged, one simulated call at a time."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def travelling_tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files
               if f and (ROOT / f.decode()).is_file())


def make_bundle(gpu: Path) -> dict[str, bytes]:
    """Stand-in parts as build_bundle.sh lays them out: core pieces and a NIXL wheel."""
    contents = {"p0/core.part.00": os.urandom(3 * MiB), "p1/core.part.01": os.urandom(3 * MiB),
                "p2/core.part.02": os.urandom(2 * MiB),
                "p3/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl": os.urandom(MiB)}
    for rel, data in contents.items():
        (gpu / rel).parent.mkdir(parents=True, exist_ok=True)
        (gpu / rel).write_bytes(data)
    (gpu / "bin").mkdir()
    return contents


def recut(gpu: Path, *parts: str, room: int = 7 * MiB // 2) -> subprocess.CompletedProcess:
    # the carry limit that leaves `room` bytes beside the tree (and the script's 2 MiB margin)
    limit = travelling_tree_bytes() + 2 * MiB + room
    env = {**os.environ, "LAYERKV_GPU_DIR": str(gpu), "LAYERKV_CARRY_LIMIT": str(limit)}
    return subprocess.run(["bash", "scripts/gpu_bundle_recut.sh", *parts], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_pieces_fit_the_room_and_stage_back_to_the_parts(tmp_path: Path) -> None:
    gpu = tmp_path / ".gpu"
    contents = make_bundle(gpu)
    r = recut(gpu)
    assert r.returncode == 0, r.stderr
    pieces = sorted(gpu.glob("q*"))
    assert len(pieces) == 3  # 9 MiB of parts (and tar headers), 3.5 MiB of room per call
    for q in pieces:
        assert sum(f.stat().st_size for f in q.iterdir()) <= 7 * MiB // 2

    home = tmp_path / "home"
    for i, q in enumerate(pieces):  # one device call per piece, each in a fresh working tree
        call = tmp_path / f"call{i}"
        (call / ".gpu").mkdir(parents=True)
        subprocess.run(["cp", "-r", str(q), str(gpu / "bin"), str(call / ".gpu")], check=True)
        out = subprocess.run(["bash", ".gpu/bin/stage_parts.sh"], cwd=call,
                             env={**os.environ, "HOME": str(home)}, capture_output=True,
                             text=True, check=True).stdout
        assert f"pieces staged: {i + 1} of 3" in out
        if i < 2:
            assert not (home / "stage" / "core.part.00").exists()
    for rel, data in contents.items():  # stage.sh's layout: every part's files side by side
        assert (home / "stage" / Path(rel).name).read_bytes() == data
    assert not list((home / "stage_parts").iterdir())  # the pieces are not kept twice


def test_named_parts_only(tmp_path: Path) -> None:
    gpu = tmp_path / ".gpu"
    make_bundle(gpu)
    r = recut(gpu, "p0", "p3", room=8 * MiB)
    assert r.returncode == 0, r.stderr
    assert [q.name for q in sorted(gpu.glob("q*"))] == ["q0"]
    assert "stage_parts" in (gpu / "bin" / "stage_parts.sh").read_text()
    assert "for p in p0 p3;" in (gpu / "bin" / "stage_parts.sh").read_text()


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    gpu = tmp_path / ".gpu"
    make_bundle(gpu)
    r = recut(gpu, "p0", "p4")
    assert r.returncode == 1
    assert "p4 does not exist" in r.stderr and "p3" in r.stderr
    assert not list(gpu.glob("q*"))
