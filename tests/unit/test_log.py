"""common/log.py: module loggers sit under vLLM's 'vllm' logger, where its handler prints them."""

from __future__ import annotations

import ast
import pathlib

from vllm_layerkv.common.log import init_logger, logger_name

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "vllm_layerkv"


def test_package_modules_map_below_vllm() -> None:
    assert logger_name("vllm_layerkv.worker.sender") == "vllm.layerkv.worker.sender"
    assert logger_name("vllm_layerkv") == "vllm.layerkv"
    assert logger_name("vllm_layerkvx.a") == "vllm_layerkvx.a"
    assert init_logger("vllm_layerkv.kv.tp").name == "vllm.layerkv.kv.tp"


def test_every_module_logger_is_named_by_its_module() -> None:
    """No hand-typed logger names: a module that logs takes init_logger(__name__)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getLogger" and path.name != "log.py"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "init_logger"
                    and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name)
                             and node.args[0].id == "__name__")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, f"name loggers with init_logger(__name__): {offenders}"
