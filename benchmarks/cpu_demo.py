"""The main job on CPU: a single vLLM instance vs LayerKV prefill/decode behind the project's
proxy, with the real SmolLM2-135M-Instruct model. Sends prompts of growing length one at a
time (streaming), prints time to first token for both, checks the generated text is identical,
and prints LayerKV's own transfer metrics.

CPU timings are a smoke test, not performance evidence: P and D get one core each, the single
instance gets one core as well (same core as P, used one request at a time), and LayerKV's sender
thread shares P's core with the prefill.

Usage: python benchmarks/cpu_demo.py [--workdir DIR] [--words 50 400 1000 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from prompts import make_prompt  # noqa: E402

from vllm_layerkv.testing.cluster import MODEL_NAME, ClusterSpec, PDCluster, metric  # noqa: E402
from vllm_layerkv.testing.models import model_path  # noqa: E402
from vllm_layerkv.testing.servers import get_text, stream_completion  # noqa: E402


def stream(url: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(ttft_s, total_s, text) of one streamed greedy completion."""
    return stream_completion(url, MODEL_NAME, prompt, max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None,
                    help="server logs and traces go here (default: a new temporary directory)")
    ap.add_argument("--words", type=int, nargs="+", default=[40, 200, 500, 900, 1300],
                    help="prompt lengths in words, one prompt each")
    ap.add_argument("--repeats", type=int, default=2, help="times each prompt is sent")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="layerkv-demo-"))
    # same scheduler budget as the single instance, so the comparison is like for like
    spec = ClusterSpec(model=model_path("smollm2"), workdir=workdir, reference_cpus="0",
                       prefill_batched_tokens=None)
    print(f"starting single instance, prefill, decode and proxy (logs in {workdir}) ...",
          flush=True)
    t = time.perf_counter()
    ok = True
    with PDCluster(spec) as cluster:
        print(f"up in {time.perf_counter() - t:.0f} s", flush=True)
        assert cluster.reference is not None and cluster.proxy is not None
        stream(cluster.reference.url, "warm up", 2)
        stream(cluster.proxy.url, "warm up", 2)
        print(f"\n{'prompt tokens':>13} | {'TTFT single (ms)':>16} | {'TTFT P/D (ms)':>13} | "
              f"{'P/D / single':>12} | same text")
        for i, words in enumerate(args.words):
            prompt = make_prompt(words, seed=1000 + i)
            singles, pds, same = [], [], True
            for r in range(args.repeats):
                salted = f"[{r}] {prompt}"  # fresh prompt each repeat: no prefix-cache hits
                t_s, _, text_s = stream(cluster.reference.url, salted, args.max_tokens)
                t_p, _, text_p = stream(cluster.proxy.url, salted, args.max_tokens)
                singles.append(t_s)
                pds.append(t_p)
                same &= text_s == text_p
            ok &= same
            n_tokens = len(prompt.split()) * 4 // 3
            s_ms, p_ms = 1e3 * statistics.median(singles), 1e3 * statistics.median(pds)
            print(f"{'~' + str(n_tokens):>13} | {s_ms:16.0f} | {p_ms:13.0f} | "
                  f"{p_ms / s_ms:12.2f} | {'yes' if same else 'NO'}", flush=True)
        _, p_metrics = get_text(cluster.prefill.url + "/metrics")
        exposed_n = metric(p_metrics, "vllm:layerkv_exposed_transfer_seconds_count")
        exposed_s = metric(p_metrics, "vllm:layerkv_exposed_transfer_seconds_sum")
        print(f"\nLayerKV: {metric(p_metrics, 'vllm:layerkv_bytes_sent_total') / 2**20:.0f} MiB "
              f"in {metric(p_metrics, 'vllm:layerkv_groups_sent_total'):.0f} layer-group sends "
              f"for {metric(p_metrics, 'vllm:layerkv_transfers_sent_total'):.0f} requests; "
              f"mean exposed transfer after the last layer: "
              f"{1e3 * exposed_s / max(exposed_n, 1):.2f} ms")
    print("outputs identical: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
