"""Run first by every process of a CPU test server (``servers.py`` puts this folder on its
PYTHONPATH): the packages that only the test tooling brings (lm-eval's scikit-learn, SciPy,
pandas, pyarrow) are made invisible to it, so the server imports what a plain install of vLLM
and LayerKV has. transformers imports scikit-learn and SciPy whenever it finds them (for
assisted generation and object-detection losses, neither of which vLLM uses): about 1.5 s of
CPU in each of a server's three processes, which a suite that starts dozens of servers on two
cores waits for. ``importlib.util.find_spec`` answers None for a name mapped to None in
``sys.modules``, so availability checks see the package as not installed, and an import of it
fails as if it were not."""

import sys

HIDDEN = ("sklearn", "scipy", "pandas", "pyarrow")

for _name in HIDDEN:
    sys.modules.setdefault(_name, None)  # type: ignore[assignment]
