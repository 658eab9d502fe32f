"""The package's floors: a module imports only from its own floor or those below it (the ground floor's modules,
then model, decoding, analysis, drafters, harness; `cli` above all). Read from the sources' import statements, so a
new module that reaches up fails here; an import under `if TYPE_CHECKING:` (annotations only) is allowed."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "magicdec"
FLOORS = ("model", "decoding", "analysis", "drafters", "harness")


def floor(module: str) -> int:
    """0: the ground floor (magicdec/*.py), then 1.. for FLOORS; cli and __main__ above them all."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FLOORS:
        return 1 + FLOORS.index(parts[1])
    return len(FLOORS) + 1 if parts[-1] in ("cli", "__main__") else 0


def imports(path: Path) -> list[str]:
    """The magicdec modules `path` imports, outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "magicdec":
            # `from magicdec.model import tp` names the module magicdec.model.tp
            found += [f"{node.module}.{a.name}" if node.module in ("magicdec", *(f"magicdec.{f}" for f in FLOORS))
                      else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "magicdec"]
    return found


def upward(root: Path) -> list[tuple[str, str]]:
    out = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        out += [(module, target) for target in imports(path) if floor(target) > floor(module)]
    return out


def test_no_module_imports_from_a_floor_above_its_own():
    assert upward(PACKAGE) == []


def test_the_check_sees_an_import_reaching_up(tmp_path):
    pkg = tmp_path / "magicdec"
    (pkg / "model").mkdir(parents=True)
    (pkg / "model" / "kv_cache.py").write_text("from magicdec.harness.engine import Engine\n"
                                               "from typing import TYPE_CHECKING\n"
                                               "if TYPE_CHECKING:\n    from magicdec.harness import run\n")
    (pkg / "config.py").write_text("def f():\n    from magicdec.model import tp\n")
    assert upward(pkg) == [("magicdec.config", "magicdec.model.tp"),
                           ("magicdec.model.kv_cache", "magicdec.harness.engine")]


@pytest.mark.parametrize("folder", FLOORS)
def test_every_floor_exists(folder):
    assert (PACKAGE / folder / "__init__.py").is_file()
