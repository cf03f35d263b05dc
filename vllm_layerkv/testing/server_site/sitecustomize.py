"""Loaded by every process of a test ``vllm serve`` (``servers.py`` puts this folder first on
its PYTHONPATH): keeps scikit-learn out of the server processes.

transformers imports ``sklearn.metrics`` (and through it scipy and pandas) whenever
scikit-learn is installed, for a generation feature vLLM never uses; the test environment has
it only because lm-eval needs it. That is about 1.5 s of CPU in each of a server's three
processes, at every one of the test suite's server starts. vLLM itself does not depend on
scikit-learn, so a server runs here as it does where scikit-learn is not installed.

A ``None`` entry in ``sys.modules`` makes ``importlib.util.find_spec`` (what transformers'
availability check calls) answer "not installed" and ``import sklearn`` fail."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

HIDDEN_PACKAGES = ("sklearn",)

for _name in HIDDEN_PACKAGES:
    sys.modules.setdefault(_name, None)  # type: ignore[assignment]


def _run_shadowed_sitecustomize() -> None:
    """Run the ``sitecustomize`` that this one shadows, if the interpreter has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run_shadowed_sitecustomize()
