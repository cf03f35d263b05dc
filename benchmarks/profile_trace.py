"""Where a LayerKV P/D request's time-to-first-token goes, from the connector and proxy traces.

Inputs (one directory, as ``ttft_bench.py --trace`` leaves them for a LayerKV configuration):
``trace.p.0`` (prefill worker), ``trace.d.0`` (decode worker), ``trace.proxy.0`` (proxy). All
three stamp events with ``time.monotonic()``, which is one clock for every process of a host.

Per request (joined by transfer_id), the segments between the proxy receiving the request and
the proxy receiving D's first bytes:

  start_delay   proxy in -> P's first step plan for the request (P tokenizes, waits for D's
                registration: ``registration_wait_s``)
  prefill       -> the sender sees the last layer group of the final chunk done on the device
                (the group's CUDA event; on CPU, the end of the group's layers)
  last_copy     -> that group's KV is in D's memory (the exposed part of the transfer; with
                ring writes, which stay in flight after the group is posted, the transfer's
                last ``piece_landed``)
  done_msg      -> D's receiver has TransferDone from every P rank and closes the transfer
  report        -> D's worker hands finished_recving to vLLM (next engine step)
  d_first       -> D's first bytes reach the proxy (D schedules the request, recomputes the last
                prompt token, samples, detokenizes, streams)

A request D reported before its transfer closed (``early_release``, row field ``early``) has
report = 0, and the D parts below count from the close: the ones vLLM got through while P
computed its last group are 0.

With P's scheduler trace (``trace.psched.0``), start_delay is split (``P_PARTS``):

  p_intake      proxy in -> P's scheduler first sees the request (HTTP, tokenization, engine
                input queue)
  reg_wait      -> P admits it: D's registration is there (or ``registration_wait_s`` ran out)
  p_plan        -> P's worker plans the first chunk's sends (the step starts)

and with D's scheduler trace too, reg_wait is split further (``REG_PARTS``; their sum is
reg_wait, a part that had happened before the one above it counts 0):

  reg_from_d    -> D's scheduler sends its registration (D took longer to get the request
                this far than P)
  reg_in        -> P's registration thread has read it (D's sender thread, the wire, and that
                thread's wait for the GIL)
  reg_pickup    -> P admits the request (P's scheduler drains it at its next step)

Where vLLM records when a request entered it (``p_seen`` and D's ``d_seen`` carry its
``arrival_time`` and the engine core's QUEUED event, ``compat.intake_marks``), each side's way
from the proxy to its scheduler is split (``INTAKE_PARTS``):

  p_api         proxy in -> P's API server has made the request (HTTP body, tokenization,
                input processing: vLLM's arrival_time)
  p_core        -> P's engine core has queued it
  p_pick        -> P's scheduler first sees it (p_seen)
  d_api, d_core, d_pick   the same on D (d_seen)
  d_alloc       -> D's scheduler sends its registration (D allocated the prompt's blocks)

With D's scheduler trace (``trace.dsched.0``, written since the decode scheduler traces too),
d_first is split further (``D_PARTS``; their sum is d_first):

  d_seen        report -> vLLM's scheduler has it (update_connector_output; with asynchronous
                scheduling the step output is processed after the next step was scheduled)
  d_sched       -> the scheduler schedules the request's first-token step (build_connector_meta)
  d_bind        -> D's worker starts that step (bind_connector_metadata)
  d_forward     -> the step's forward is launched (wait_for_save; the GPU may still run it)
  d_out         -> D's first bytes reach the proxy (sampling, output processing, detokenizing,
                the HTTP stream)

With the first token from P (the proxy's ``--first-token-from-prefill``: its trace has
``proxy_p_token``), the client's first token is P's (``FT_PARTS``):

  p_answer      the sender sees P's last layer group done -> P's token reaches the proxy
                (P's sampling, output processing, its API server's JSON answer)
  ft_total      proxy in -> P's token at the proxy: the TTFT the proxy sees

and with P's scheduler trace, p_answer is split (``ANSWER_PARTS``; their sum is p_answer):

  p_to_engine   -> P's scheduler has the finished request (the rest of the forward, sampling,
                the step's output back to the engine core)
  p_frontend    -> P's token at the proxy (engine core to API server, the JSON answer, HTTP)

On GPU, P's trace also says when each group was ready on the device (``group_ready``, a
timing event recorded when the step was planned), which splits prefill (``GPU_PARTS``):

  p_gpu         the GPU time of the request's steps: per chunk, from the step's start on
                the device to its last group done (a chunked prompt's steps added up; the
                engine may plan a chunk while the device still runs the one before)
  send_wait     prefill - p_gpu: the sender still busy with earlier groups when the last one
                was ready (0 when the link kept up), plus the engine's time between chunks

    python benchmarks/profile_trace.py DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

SEGMENTS = ("start_delay", "prefill", "last_copy", "done_msg", "report", "d_first")
D_PARTS = ("d_seen", "d_sched", "d_bind", "d_forward", "d_out")
D_MARKS = ("recv_seen", "d_scheduled", "d_step_bound", "d_step_launched")
P_PARTS = ("p_intake", "reg_wait", "p_plan")
P_MARKS = ("p_seen", "p_admitted")
REG_PARTS = ("reg_from_d", "reg_in", "reg_pickup")
FT_PARTS = ("p_answer", "ft_total")
ANSWER_PARTS = ("p_to_engine", "p_frontend")
GPU_PARTS = ("p_gpu", "send_wait")
INTAKE_PARTS = ("p_api", "p_core", "p_pick", "d_api", "d_core", "d_pick", "d_alloc")


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def request_breakdowns(trace_dir: Path) -> list[dict[str, Any]]:
    """One dict per request seen by all three traces: prompt tokens P computed, each segment in
    ms, and the total (proxy in -> D's first bytes)."""
    p_events = read_events(trace_dir / "trace.p.0")
    d_events = read_events(trace_dir / "trace.d.0")
    proxy = read_events(trace_dir / "trace.proxy.0")

    plans: dict[str, list[dict[str, Any]]] = defaultdict(list)
    sends: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    ready_s: dict[tuple[int, int], float] = {}
    done_sent: dict[str, float] = {}
    landed: dict[str, float] = {}
    for e in p_events:
        if e["ev"] == "step_plan":
            for tid in e.get("transfer_ids", []):
                plans[tid].append(e)
        elif e["ev"] in ("group_send_start", "group_send_end"):
            sends[(e["step"], e["group"])].setdefault(e["ev"], e["t"])
        elif e["ev"] == "group_ready":
            ready_s[(e["step"], e["group"])] = e["gpu_s"]
        elif e["ev"] == "transfer_done_sent":
            done_sent[e["transfer_id"]] = e["t"]
        elif e["ev"] == "piece_landed":
            landed[e["transfer_id"]] = max(e["t"], landed.get(e["transfer_id"], 0.0))

    closed: dict[str, dict[str, Any]] = {}
    reported: dict[str, float] = {}
    for e in d_events:
        if e["ev"] == "recv_closed":
            closed[e["transfer_id"]] = e
        elif e["ev"] == "recv_reported":
            for req_id in e["req_ids"]:
                reported.setdefault(req_id, e["t"])

    # D's first-token step: scheduler marks (trace.dsched.0) and worker marks (trace.d.0)
    d_marks: dict[str, dict[str, float]] = defaultdict(dict)
    for e in read_events(trace_dir / "trace.dsched.0") + d_events:
        if e["ev"] in D_MARKS:
            for req_id in e["req_ids"]:
                d_marks[req_id].setdefault(e["ev"], e["t"])

    p_marks: dict[str, dict[str, float]] = defaultdict(dict)
    intake: dict[str, dict[str, float]] = defaultdict(dict)
    for e in read_events(trace_dir / "trace.psched.0") + read_events(trace_dir / "trace.dsched.0"):
        if e["ev"] in (*P_MARKS, "reg_arrived", "d_registering", "p_finished"):
            p_marks[e["transfer_id"]].setdefault(e["ev"], e["t"])
        if e["ev"] in ("p_seen", "d_seen") and e.get("transfer_id"):
            side = intake[e["transfer_id"]]
            for mark in ("arrival", "queued", "t"):
                if mark in e:
                    side.setdefault(f"{e['ev'][0]}_{mark}", e[mark])

    proxy_t: dict[str, dict[str, float]] = defaultdict(dict)
    for e in proxy:
        proxy_t[e["transfer_id"]].setdefault(e["ev"], e["t"])

    rows = []
    for tid, pt in proxy_t.items():
        tid_plans = plans.get(tid)
        final = [p for p in tid_plans or [] if tid in p.get("final", [])]
        if not tid_plans or not final or tid not in closed or "proxy_d_first" not in pt:
            continue  # not streamed (short prompt), or a trace is missing: no breakdown
        last = final[-1]
        group_times = sends.get((last["step"], last["groups"] - 1), {})
        req_id = closed[tid]["req_id"]
        if ("group_send_start" not in group_times or req_id not in reported
                or tid not in done_sent):
            continue
        # reported before it closed (early_release): report = 0, and D's parts count from the
        # close (what vLLM did before it overlapped P's last group)
        early = reported[req_id] < closed[tid]["t"]
        handed_over = max(reported[req_id], closed[tid]["t"])
        sent = max(group_times["group_send_end"], landed.get(tid, 0.0))
        marks = [pt["proxy_in"], tid_plans[0]["t"], group_times["group_send_start"],
                 sent, closed[tid]["t"], handed_over,
                 pt["proxy_d_first"]]
        row: dict[str, Any] = {
            "transfer_id": tid,
            "prompt_tokens_computed": sum(p["tokens"] for p in tid_plans),
            "chunks": len(tid_plans),
            "nbytes": closed[tid]["nbytes"],
            "early": early,
        }
        for name, a, b in zip(SEGMENTS, marks, marks[1:]):
            row[name] = round((b - a) * 1000, 2)
        row["total"] = round((marks[-1] - marks[0]) * 1000, 2)
        if "proxy_p_token" in pt:
            row["p_answer"] = round((pt["proxy_p_token"] - group_times["group_send_start"])
                                    * 1000, 2)
            row["ft_total"] = round((pt["proxy_p_token"] - pt["proxy_in"]) * 1000, 2)
            finished = p_marks.get(tid, {}).get("p_finished")
            if finished is not None:
                at = min(max(finished, group_times["group_send_start"]), pt["proxy_p_token"])
                row["p_to_engine"] = round((at - group_times["group_send_start"]) * 1000, 2)
                row["p_frontend"] = round((pt["proxy_p_token"] - at) * 1000, 2)
        device_s = [ready_s.get((p["step"], p["groups"] - 1)) for p in tid_plans]
        if all(s is not None for s in device_s):
            row["p_gpu"] = round(sum(device_s) * 1000, 2)  # type: ignore[arg-type]
            row["send_wait"] = round(max(0.0, row["prefill"] - row["p_gpu"]), 2)
        pm = p_marks.get(tid, {})
        if all(m in pm for m in P_MARKS):
            p = [pt["proxy_in"], *(pm[m] for m in P_MARKS), tid_plans[0]["t"]]
            for name, a, b in zip(P_PARTS, p, p[1:]):
                row[name] = round((b - a) * 1000, 2)
            if "reg_arrived" in pm and "d_registering" in pm:
                reg = [pm["p_seen"]]
                for t in (pm["d_registering"], pm["reg_arrived"], pm["p_admitted"]):
                    reg.append(max(reg[-1], t))
                for name, a, b in zip(REG_PARTS, reg, reg[1:]):
                    row[name] = round((b - a) * 1000, 2)
        row.update(intake_parts(pt["proxy_in"], intake.get(tid, {}),
                                p_marks.get(tid, {}).get("d_registering")))
        dm = d_marks.get(req_id, {})
        if all(m in dm for m in D_MARKS):
            d = [handed_over]
            for t in (*(dm[m] for m in D_MARKS), pt["proxy_d_first"]):
                d.append(max(d[-1], t))  # early: marks before the close count as 0
            for name, a, b in zip(D_PARTS, d, d[1:]):
                row[name] = round((b - a) * 1000, 2)
        rows.append(row)
    return rows


def intake_parts(proxy_in: float, marks: dict[str, float], registering: float | None
                 ) -> dict[str, float]:
    """``INTAKE_PARTS`` of one request, each side's only where vLLM recorded both of its
    marks."""
    parts: dict[str, float] = {}
    for side in ("p", "d"):
        names = [f"{side}_arrival", f"{side}_queued", f"{side}_t"]
        if all(n in marks for n in names):
            ts = [proxy_in, *(marks[n] for n in names)]
            for name, a, b in zip(("api", "core", "pick"), ts, ts[1:]):
                parts[f"{side}_{name}"] = round((b - a) * 1000, 2)
    if "d_pick" in parts and registering is not None:
        parts["d_alloc"] = round((registering - marks["d_t"]) * 1000, 2)
    return parts


def medians_by_length(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Median of each segment per prompt length (P's computed tokens rounded to 256)."""
    by_len: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_len[round(r["prompt_tokens_computed"] / 256) * 256].append(r)
    out = {}
    for n, rs in sorted(by_len.items()):
        keys = [*SEGMENTS, "total"]
        for parts in (GPU_PARTS, P_PARTS, REG_PARTS, INTAKE_PARTS, D_PARTS, FT_PARTS,
                      ANSWER_PARTS):
            if all(k in r for r in rs for k in parts):
                keys += parts
        out[n] = {"requests": len(rs), **{k: round(statistics.median(r[k] for r in rs), 2)
                                          for k in keys}}
    return out


def format_table(medians: dict[int, dict[str, float]]) -> str:
    cols: tuple[str, ...] = ("requests", *SEGMENTS, "total")
    for parts in (GPU_PARTS, P_PARTS, REG_PARTS, INTAKE_PARTS, D_PARTS, FT_PARTS, ANSWER_PARTS):
        if medians and all(k in m for m in medians.values() for k in parts):
            cols += parts
    lines = ["| prompt tokens (P computed) | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for n, m in medians.items():
        lines.append(f"| {n} | " + " | ".join(f"{m[c]:g}" for c in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--json", type=Path, help="also write rows + medians here")
    args = ap.parse_args()
    rows = request_breakdowns(args.trace_dir)
    if not rows:
        print(f"no request found in all of P, D and proxy traces under {args.trace_dir}",
              file=sys.stderr)
        return 1
    medians = medians_by_length(rows)
    print("median ms per segment (proxy in -> D's first bytes)")
    print(format_table(medians))
    if args.json:
        args.json.write_text(json.dumps({"medians": medians, "requests": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
