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


NEW_DRAFTER = '''
from dataclasses import dataclass

from magicdec.decoding.generate import Drafter
from magicdec.drafters.base import DrafterKind
from magicdec.options import option


class Repeat(Drafter):
    def propose(self, step, hist, m, start, gamma):
        last = hist.gather(1, (m - 1)[:, None])
        return last.expand(-1, gamma).clone(), None


@dataclass(frozen=True)
class Config:
    repeat_note: int = option(0, "unused: a new drafter's own flag")


class RepeatKind(DrafterKind):
    name = "repeat"
    description = "the last committed token, gamma times"
    Config = Config
    supports_auto_gamma = False

    def prepare(self, cfg, ctx):
        return Repeat()


DRAFTER = RepeatKind()
'''

NEW_DRAFTER_RUN = """
import contextlib, io, json, sys
from magicdec import drafters
drafters.__path__.append(sys.argv[1])  # the new module's folder, as if the file were in magicdec/drafters/
from magicdec.cli import run_parser, run_record
help = run_parser("d").format_help()
tiny = sys.argv[2:] + ["--save_tokens", "--no_progress", "--ignore_eos", "--gen_len", "12"]
with contextlib.redirect_stdout(io.StringIO()):
    plain = run_record(tiny)["generated_ids"]
    record = run_record(tiny + ["--drafter", "repeat", "--gamma", "2"])
print(json.dumps({"names": drafters.names(), "help": "--repeat_note" in help and "drafter repeat" in help,
                  "same": record["generated_ids"] == plain, "method": record["method"],
                  "iterations": record["metrics"]["speculation"]["iterations"]}))
"""


def test_a_new_drafter_is_one_file(tmp_path):
    """A drafter module dropped beside the others, and nothing else edited: it is registered, has its flags in
    --help, and runs with greedy ids equal to plain decoding."""
    from conftest import TINY_RUN

    (tmp_path / "repeat.py").write_text(NEW_DRAFTER)
    p = subprocess.run([sys.executable, "-c", NEW_DRAFTER_RUN, str(tmp_path), *TINY_RUN], capture_output=True,
                       text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "repeat" in got["names"] and got["help"] and got["same"] and got["method"] == "repeat"
    assert got["iterations"] > 0
