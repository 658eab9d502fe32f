"""The `magicdec` command: `run` (one run), `compare` (every drafter side by side on one prefill: the default job),
`sweep` (a grid from a TOML file), `report` (records to tables and plots), `reproduce` (a headline claim, PASS or
FAIL), `datastore` (REST's), `train-head` (an EAGLE, Medusa or Hydra draft head for a target). The run flags are
the run config's options (magicdec/harness/run_config.py and each drafter's own)."""
from __future__ import annotations

import argparse
import importlib
import sys

from magicdec import drafters
from magicdec import options as opt
from magicdec.errors import MagicDecError, one_line_errors
from magicdec.harness.run_config import SECTIONS, RunConfig

SECTION_TITLES = {"models": "the target model", "workload": "workload", "decoding": "decoding",
                  "speculation": "speculation", "runtime": "runtime", "timing": "timing", "output": "output",
                  "plan": "plan (the cost model's ranking picks the drafter: magicdec plan's, then timed)"}


class Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def run_parser(description: str, defaults: dict | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """Every option of the run config as a flag, in groups: the sections, the options several drafters share (one
    flag each, naming its drafters), then each drafter's own. --help shows `defaults` (a script's own) over the
    config's."""
    defaults = defaults or {}
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=Formatter,
                                epilog="Options of a drafter apply only when it is the run's --drafter.")
    taken: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        opt.add_flags(p.add_argument_group(SECTION_TITLES[name]), cls, defaults, taken)
    kinds = drafters.registry()
    owners = {k: drafters.owners(k) for kind in kinds.values() for k in opt.keys(kind.Config)}
    shared = {k: names for k, names in owners.items() if len(names) > 1}
    group = p.add_argument_group("options of several drafters", "each applies to the drafters named after it")
    for kind in kinds.values():
        opt.add_flags(group, kind.Config, defaults, taken, shared, only=shared)
    for name, kind in kinds.items():
        also = [opt.flag_of(f) for f in opt.fields(kind.Config) if f.name in shared]
        opt.add_flags(p.add_argument_group(
            f"drafter {name}" + (f" (also: {', '.join(kind.aliases)})" if kind.aliases else ""),
            kind.description + (f"\nalso takes {', '.join(also)} (options of several drafters, above)" if also else "")),
            kind.Config, defaults, taken)
    no_auto = [n for n, k in drafters.registry().items() if not k.supports_auto_gamma]
    gamma = next(a for a in p._actions if a.dest == "gamma")
    if no_auto:
        gamma.help = gamma.help.replace("'auto':", f"'auto' (not for {', '.join(no_auto)}):")
    legacy = p.add_argument_group("other")
    for name, kind in drafters.registry().items():
        if kind.switch:
            legacy.add_argument(kind.switch, dest="drafter", action="store_const", const=name,
                                default=argparse.SUPPRESS, help=f"the same as --drafter {name}")
    legacy.add_argument("--benchmark", action="store_true", default=argparse.SUPPRESS,
                        help="accepted and ignored: runs are always timed (kept so MagicDec's command lines work)")
    legacy.add_argument("--replay", metavar="RECORD.json", default=argparse.SUPPRESS,
                        help="run again exactly what a record ran (its config); only output options may be added")
    return p


def config_from_argv(argv: list[str] | None, description: str, defaults: dict | None = None,
                     prog: str | None = None) -> RunConfig:
    ns = vars(run_parser(description, defaults, prog).parse_args(argv))
    ns.pop("benchmark", None)
    replay = ns.pop("replay", None)
    if replay is not None:
        others = sorted(set(ns) - opt.keys(SECTIONS["output"]))
        if others:
            raise MagicDecError(f"--replay reruns what the record ran: only output options may be added, not "
                                f"--{others[0]}")
        return RunConfig.from_record(replay, ns)
    return RunConfig.from_options(ns, defaults)


RUN_DESCRIPTION = "One timed run: a drafter (or the baseline) on the target."


def run_main(argv=None, description: str = RUN_DESCRIPTION, defaults: dict | None = None, prog: str | None = None,
             rename: dict | None = None) -> None:
    """A run from the command line: bad input as one line (exit 2)."""
    from magicdec.harness import run
    run.main(lambda: config_from_argv(argv, description, defaults, prog), rename)


def run_record(argv=None, description: str = RUN_DESCRIPTION, defaults: dict | None = None) -> dict:
    """A run in this process (tests): its record; bad input raises MagicDecError."""
    from magicdec.harness import run
    return run.run(config_from_argv(argv, description, defaults))


COMMANDS = {
    "run": "one timed run (magicdec run --help for its flags)",
    "compare": "every drafter side by side over one shared prefill (the default job; runs on a CPU in about a minute)",
    "sweep": "a grid of runs from a TOML file, one record per point, resumable",
    "report": "sweep records to tables, plots and a results page; specbench-table, tp-tables, heads-acceptance, "
              "atlas",
    "plan": "rank every drafter's composed options by the cost model's predicted speedup at one point (no GPU)",
    "option-acceptance": "measure each option the plan ranks on a real model (one run each): plan --acceptance's file",
    "reproduce": "run a headline experiment (experiments/*.toml) and print PASS or FAIL",
    "datastore": "REST's datastore: books tokenized with the target's tokenizer, and a suffix array over them",
    "train-head": "train a draft head (eagle, eagle3, medusa, hydra) for a target on a text corpus, resumable",
    "generate-data": "the target's own sampled continuations of training-book contexts, for train-head --data "
                     "generated; resumable",
}
# the module whose main() each command runs (run has its own parser here)
MODULES = {"compare": "magicdec.harness.compare", "sweep": "magicdec.harness.sweep",
           "report": "magicdec.harness.report", "plan": "magicdec.harness.plan_command", "reproduce": "magicdec.harness.reproduce",
           "option-acceptance": "magicdec.harness.option_acceptance",
           "datastore": "magicdec.drafters.datastore", "train-head": "magicdec.harness.train_head",
           "generate-data": "magicdec.harness.generate_data"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        print("usage: magicdec COMMAND [flags]\n\n" + "\n".join(f"  {c:<{width}}  {h}" for c, h in COMMANDS.items()))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        run_main(rest, prog="magicdec run")
        return 0
    module = importlib.import_module(MODULES[command])
    with one_line_errors():
        return module.main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
