"""lm-eval's command line (``python -m lm_eval``) for tasks that all come from ``--include_path``:
``python -m vllm_layerkv.testing.lm_eval_cli`` takes the same arguments and runs the same
evaluation, but indexes only the ``--include_path`` folders, not lm-eval's built-in tasks.

lm-eval's command line always builds its task index over the built-in tasks as well: several
thousand YAML files, parsed at every start (about 12 s of CPU on the 2-core CI machine, more
than lm-eval's imports). The tasks of :mod:`vllm_layerkv.testing.eval_tasks` are
self-contained files in one folder (no built-in template, group or tag), so that index finds
nothing they use."""

from __future__ import annotations

import sys
from typing import Any

import lm_eval.tasks


class IncludedTasksOnly(lm_eval.tasks.TaskManager):
    """lm-eval's TaskManager over ``include_path`` alone (``include_defaults=False``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["include_defaults"] = False
        super().__init__(*args, **kwargs)


def main() -> None:
    # the command line looks TaskManager up in lm_eval.tasks when it builds its task list
    lm_eval.tasks.TaskManager = IncludedTasksOnly  # type: ignore[misc]
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
