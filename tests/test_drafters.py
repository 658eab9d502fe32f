"""The drafters' registry (magicdec/drafters/__init__.py): drafters found by listing the package, a drafter's module
imported when it is asked for by name, aliases and capabilities read off the kinds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from magicdec import drafters
from magicdec.errors import MagicDecError

IMPORTED = """
import json, sys
from magicdec import drafters
from magicdec.harness.run_config import RunConfig

def imported():
    return sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith("magicdec.drafters."))

RunConfig.from_options({"drafter": "lookup"})  # a run's config: its drafter's kind, options and checks
print(json.dumps(imported()))
drafters.canonical("longspec")
print(json.dumps(imported()))
"""


def test_a_drafter_asked_for_by_name_imports_its_module_alone():
    p = subprocess.run([sys.executable, "-c", IMPORTED], capture_output=True, text=True, cwd=REPO,
                       env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-2000:]
    lookup, after_alias = (set(json.loads(line)) for line in p.stdout.splitlines()[-2:])
    assert "lookup" in lookup and not lookup & (set(drafters.names()) - {"lookup"})
    assert set(drafters.names()) <= after_alias  # an alias is on no module's name: looked up across every drafter


def test_every_drafter_is_its_module_and_aliases_resolve():
    assert drafters.names() == sorted(drafters.names()) and "base" not in drafters.names()
    assert {m for m in drafters.modules() if m in drafters.names()} == set(drafters.names())
    for name, kind in drafters.registry().items():
        assert kind.name == name and drafters.get(name) is kind
        for alias in kind.aliases:
            assert drafters.canonical(alias) == name and drafters.get(alias) is kind
    assert drafters.canonical("longspec") == "standalone" and drafters.canonical("baseline") == "baseline"
    for unknown in ("quokka", "base", "model_draft"):  # a module that defines no drafter is none
        with pytest.raises(MagicDecError, match=f"unknown drafter '{unknown}': choose baseline or one of eagle, "):
            drafters.canonical(unknown)


def test_capabilities_are_read_off_the_kinds():
    trees = drafters.having("supports_trees")
    assert {"selfspec", "standalone", "lookup", "rest", "eagle", "medusa"} <= set(trees) and "hierarchy" not in trees
    assert {"selfspec", "standalone", "eagle"} <= set(drafters.having("drafts_shaped_trees")) <= set(trees)
    assert "lookup" not in drafters.having("drafts_shaped_trees")
