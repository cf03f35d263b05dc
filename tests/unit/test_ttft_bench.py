"""benchmarks/ttft_bench.py: the pieces that do not need a server."""

from __future__ import annotations

import numpy as np
import pytest

from benchmark_scripts import load

ttft_bench = load("ttft_bench")


def test_every_benchmark_point_has_its_own_seed() -> None:
    points = [(c, i, o) for c in (1, 16, 64) for i in (64, 1024, 4096, 8192, 16000)
              for o in (8, 128, 512)]
    seeds = {ttft_bench.dataset_seed(*p) for p in points}
    assert len(seeds) == len(points)


@pytest.mark.parametrize("point", [(1, 16000, 8), (64, 16000, 512), (999, 10**6, 10**5)])
def test_seed_is_one_vllm_bench_serve_accepts(point: tuple[int, int, int]) -> None:
    seed = ttft_bench.dataset_seed(*point)
    assert 0 <= seed < 2**32
    np.random.seed(seed)  # what vllm bench serve does with it (raises past 2**32 - 1)
