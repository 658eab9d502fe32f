"""Claims as experiments: each headline number of the README is a small TOML file under experiments/ — the run's
options, the device it needs, the record it cites, the metric, the value expected and the tolerance. `magicdec
reproduce FILE` runs it (on a device of that class) and prints PASS or FAIL with the measured value; `magicdec
reproduce --table` writes the README's headline table from every experiment and the record it cites.

    magicdec reproduce experiments/selfspec_llama31_8b_32k_b13.toml --output results/selfspec/llama31_8b_32k_b13.json
    magicdec reproduce --table --readme README.md

An experiment file:

    claim = "Llama-3.1-8B self-spec, 32K x 13, budget 512, gamma 2-4"     # the row's setting
    paper = "—"                                                           # a peer's number, with what differs
    device = "H100"                                                       # the GPU name must contain it
    record = "results/selfspec/llama31_8b_32k_b13.json"                   # the record the README cites
    metric = "metrics.measured_speedup_first_done"                        # a dotted path into the record
    expected = 1.54                                                       # the value the README states
    tolerance = 0.05                                                      # relative: PASS within ±5%
    acceptance = "SmolLM2's alpha at 8K"                                  # optional: where a synthetic rate came from
    prediction = "1.73× at TP = 8 (cost model)"                           # ours for the paper's setup, if any
    details = "results/selfspec/README.md"
    order = 10                                                            # the row's place in the table
    [run]                                                                 # the run's options (magicdec run)
    drafter = "selfspec"
    ...
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tomllib
from pathlib import Path

from magicdec.decoding.acceptance import source_label
from magicdec.errors import MagicDecError
from magicdec.files import write_record, write_text
from magicdec.harness.run_config import RunConfig, writable_folder

KEYS = {"claim", "paper", "device", "record", "metric", "expected", "tolerance", "acceptance",
        "prediction", "details", "run", "also", "note", "order"}
REQUIRED = ("claim", "device", "record", "metric", "expected", "tolerance", "run")
NUMBERS = {"expected", "tolerance", "order"}  # the others are strings, but run (a table)
README_MARKERS = ("<!-- headline table: magicdec reproduce --table -->", "<!-- /headline table -->")


def load(path: Path) -> dict:
    try:
        exp = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise MagicDecError(f"cannot read experiment {path}: {e}") from None
    missing = [k for k in REQUIRED if k not in exp]
    unknown = sorted(set(exp) - KEYS)
    if missing or unknown:
        raise MagicDecError(f"experiment {path}: " + (f"missing {missing}" if missing else f"unknown keys {unknown}")
                            + f"; an experiment has {sorted(KEYS)}")
    for key, value in exp.items():
        if key in NUMBERS:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, "a number >= 0"
        elif key == "run":
            ok, what = isinstance(value, dict), "a table of run options"
        else:
            ok, what = isinstance(value, str), "a string"
        if not ok:
            raise MagicDecError(f"experiment {path}: {key} = {value!r}: must be {what}")
    exp["path"] = Path(path)
    return exp


def metric(record, path: str):
    """The value at a dotted path: keys of dicts (a key holding dots in double quotes), indices of lists."""
    value = record
    for quoted, plain in re.findall(r'"([^"]*)"|([^.]+)', path):
        part = quoted or plain
        if isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def value_of(record: dict, path: str):
    """The metric an experiment names, as the project reports it: a speedup whose record lists its rounds' own
    ratios is their median (records made before that rule stored the ratio of the median runs' rates, the median
    chosen by seconds), any other metric the record's value."""
    rounds = metric(record, path + "_rounds")
    if path.split(".")[-1].startswith("measured_speedup") and isinstance(rounds, list) and rounds and \
            all(isinstance(r, (int, float)) for r in rounds):
        return statistics.median(rounds)
    return metric(record, path)


def verdict(exp: dict, value) -> tuple[bool, str]:
    if value is None:
        return False, f"FAIL: {exp['metric']} is missing from the record"
    lo, hi = exp["expected"] * (1 - exp["tolerance"]), exp["expected"] * (1 + exp["tolerance"])
    ok = lo <= value <= hi
    return ok, (f"{'PASS' if ok else 'FAIL'}: {exp['metric']} = {value:.4g}, expected {exp['expected']:.4g} "
                f"± {exp['tolerance']:.0%} ({lo:.4g}..{hi:.4g})")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def on_device_class(wanted: str) -> bool:
    """Whether this machine is of the class an experiment names: "H100", or "4 x H200" (that many such GPUs)."""
    import torch

    count, _, name = wanted.rpartition(" x ")
    n = int(count) if count.strip().isdigit() else 1
    return torch.cuda.is_available() and torch.cuda.device_count() >= n and \
        (name or wanted).lower() in torch.cuda.get_device_name().lower()


def off_class_overrides(exp: dict) -> dict:
    """What a run off its device class changes so that it runs here at all: on a machine without CUDA, the CPU, and
    eager steps where the experiment captures CUDA graphs."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {"device": "cpu"} | ({"step_mode": "eager"} if exp["run"].get("step_mode", "eager") != "eager" else {})


def reproduce(exp: dict, output: Path | None, anywhere: bool = False) -> tuple[bool, dict]:
    """Run the experiment's config; its record (written to `output`) and whether its metric is within tolerance.
    Off its device class (`anywhere`) the run is a look: its value is printed and recorded as not comparable, with
    no PASS or FAIL, and on a machine without CUDA it runs on the CPU with eager steps."""
    from magicdec.harness import run
    here = device_name()
    comparable = on_device_class(exp["device"])
    overrides = {} if comparable else off_class_overrides(exp)
    if not comparable and not anywhere:
        how = ", on the CPU with eager steps" if "device" in overrides else ""
        raise MagicDecError(f"{exp['path']} was measured on {exp['device']} and this is {here}: its tolerance holds on "
                            f"that device class only; add --anywhere to run it here for a look (no PASS or FAIL{how})")
    cfg = RunConfig.from_options(dict(exp["run"]) | overrides | ({"output": str(output)} if output else {}),
                                 where=f"{exp['path']} [run]: ")
    if output:
        writable_folder(output.parent, f"--output {output}")
    try:
        record = run.run(cfg)
    except MagicDecError as e:
        if comparable:
            raise
        raise MagicDecError(f"{exp['path']} cannot run on this {here}: {e}; the experiment fixes its [run] options: "
                            f"run it on {exp['device']}, or time a smaller copy of them with magicdec run") from None
    if not run.writes_records():  # a tensor-parallel run: rank 0 alone judges, prints and writes
        return True, record
    value = value_of(record, exp["metric"])
    if comparable:
        ok, line = verdict(exp, value)
    else:
        shown = f"{value:.4g}" if isinstance(value, (int, float)) else "missing"
        changed = "".join(f", {k} {v}" for k, v in overrides.items())
        ok, line = True, (f"NOT COMPARABLE: {exp['metric']} = {shown} on {here}{changed}; the claim "
                          f"({exp['expected']:.4g} ± {exp['tolerance']:.0%}) holds on {exp['device']} only")
    record["reproduce"] = {"experiment": str(exp["path"]), "verdict": line, "pass": ok if comparable else None,
                           "device": here, "comparable": comparable, "overrides": overrides}
    if output:
        write_record(output, record)
    print(f"{exp['claim']}: {line}")
    return ok, record


def reproduce_all(files: list[Path], output_dir: Path) -> int:
    """Every experiment of this machine's device class rerun in turn, its record to output_dir/NAME.json; a summary
    line per experiment (PASS, FAIL, or skipped and why) at the end. Exit status 1 if any ran and failed."""
    import torch

    from magicdec import device as dev
    experiments = [load(f) for f in files]  # every file checked before anything runs
    writable_folder(output_dir, f"--output_dir {output_dir}")
    lines, ok = [], True
    for exp in experiments:
        if not on_device_class(exp["device"]):
            lines.append(f"{exp['path'].stem}: skipped, measured on {exp['device']} (this is {device_name()})")
            continue
        try:
            passed, record = reproduce(exp, output_dir / f"{exp['path'].stem}.json")
        except Exception as e:  # noqa: BLE001 - one experiment's failure (out of memory, a bad flag) is its line
            passed, record = False, {"reproduce": {"verdict": f"ERROR: {type(e).__name__}: {str(e).splitlines()[0]}"}}
        finally:
            dev.release_memory(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        ok &= passed
        lines.append(f"{exp['path'].stem}: {record['reproduce']['verdict']}")
    print("\n".join(lines))
    return 0 if ok else 1


def cited_path(exp: dict, root: Path | None = None) -> Path:
    """The experiment's committed record: its path is relative to the repository, the folder above experiments/."""
    return (root or Path(exp["path"]).resolve().parent.parent) / exp["record"]


def cited(exp: dict, root: Path | None = None) -> tuple[float | None, dict | None]:
    """The value the experiment's committed record holds, and the record (None, None where it cannot be read)."""
    try:
        record = json.loads(cited_path(exp, root).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None, None
    return (value_of(record, exp["metric"]), record) if isinstance(record, dict) else (None, None)


def check_cited(experiments: list[dict]) -> None:
    """Every experiment's record is there and holds its metric: a table row without its number is no table."""
    for exp in experiments:
        value, record = cited(exp)
        if record is None:
            path = cited_path(exp)
            what = "is missing" if not path.exists() else "cannot be read as a JSON record"
            raise MagicDecError(f"{exp['path']} cites {exp['record']}, which {what}: restore it (git checkout -- "
                                f"{exp['record']}) or remake it on {exp['device']} (magicdec reproduce {exp['path']} "
                                f"--output {exp['record']})")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise MagicDecError(f"{exp['path']} cites {exp['metric']} of {exp['record']}, which holds no number "
                                f"there: fix the experiment's metric, or remake the record on {exp['device']}")


COLUMNS = ("setting", "paper (its device, weights, data, decoding)", "ours", "spread of the rounds", "device",
           "weights", "acceptance", "decoding, tokens", "our prediction", "check", "reproduce")


def spread(exp: dict, record: dict) -> str:
    """The per-round values of the metric (each timed round's speedup over the same round's baseline), or what the
    record cannot give."""
    rounds = metric(record, exp["metric"] + "_rounds")
    if isinstance(rounds, list) and len(rounds) >= 3:
        return f"{min(rounds):.3f}–{max(rounds):.3f} ({len(rounds)} interleaved rounds)"
    return "single run, not interleaved"


def names(record: dict) -> list[str]:
    cfg = record.get("config") or {}
    target = cfg.get("model_name") or (record.get("model_config") or {}).get("name") or "not recorded"
    return [target] + [d.get("name") or "not recorded" for d in (record.get("draft_models") or {}).values()]


def kernels(record: dict) -> str:
    """The kernel each quantized draft layer ran, as the run's preparation reported it (every batch shape it met)."""
    used = {}
    for shape in ((record.get("drafter_notes") or {}).get("draft_weights") or {}).get("kernels") or []:
        for kernel, n in (shape.get("layers_by_kernel") or {}).items():
            used[kernel] = max(used.get(kernel, 0), n)
    return ", ".join(f"{k} on {n} layers" for k, n in sorted(used.items())) or "kernel not recorded"


def weights(record: dict) -> str:
    """Random or real weights and whose shapes, the draft's weight and KV formats and the kernels that ran them,
    from the record."""
    cfg, models = record.get("config") or {}, names(record)
    if record.get("random_weights") is None:
        label = "not recorded"
    elif record["random_weights"]:
        label = "random, " + " and ".join(f"{m}'s" for m in models) + " shapes"
    else:
        label = "real: " + (Path(record["checkpoint"]).parent.name if record.get("checkpoint") else models[0])
    if cfg.get("draft_weights") not in (None, "bf16"):
        label += f"; the draft's weights {cfg['draft_weights']} ({kernels(record)})"
    if cfg.get("draft_kv") not in (None, "bf16"):
        label += f"; the draft's KV {cfg['draft_kv']}"
    return label


def acceptance(exp: dict, record: dict) -> str:
    """Where α came from: the record's acceptance source (acceptance.source_label), or measured on the prompts;
    the experiment's `acceptance` adds where a rate was taken from."""
    cfg, m = record.get("config") or {}, record.get("metrics") or {}
    label = source_label(cfg)
    if label is None and isinstance(m.get("alpha"), (int, float)):
        label = f"measured: α {m['alpha']:.2f} on {record.get('prompt_source') or 'prompts not recorded'}"
    elif label is None:
        label = "not recorded"
    return label + (f"; {exp['acceptance']}" if exp.get("acceptance") else "")


def decoding(exp: dict, record: dict) -> str:
    """Greedy or sampled, and the tokens generated, from the record's run config (else the experiment's)."""
    cfg = record.get("config") if isinstance(record.get("config"), dict) else exp["run"]
    temperature, tokens = cfg.get("temperature") or 0, cfg.get("gen_len")
    how = "greedy" if not temperature else f"sampled, T {temperature}, top-p {cfg.get('top_p', 1.0)}"
    return f"{how}, {tokens} tokens" if tokens else how


def rerun(exp: dict, record: dict) -> str:
    """What `magicdec reproduce` said when it made the record, against the claim of that time: a failure against a
    claim since changed (a re-measurement under other settings) names that claim, so it is not read as this row's."""
    when = (record.get("reproduce") or {}).get("verdict")
    if not when:
        return ""
    date = (record.get("environment") or {}).get("date")
    on = f" ({date[:10]})" if date else " (date not recorded)"
    judged = re.match(r"\w+: (\S+) (=|is missing)", when)
    if judged and judged.group(1) != exp["metric"]:  # the experiment names another metric since
        on += f" of {judged.group(1)}"
    then = re.search(r"expected (\S+) ±", when)
    if when.startswith("FAIL") and then and float(then.group(1)) != float(f"{exp['expected']:.4g}"):
        return f" · rerun{on} against the earlier claim {then.group(1)}: {when.split(':')[0]}"
    return f" · rerun{on}: " + when.split(":")[0]


COMPANION = {"measured_speedup": ("measured_speedup_first_done", "first done"),
             "measured_speedup_first_done": ("measured_speedup", "all reach")}


def companion(exp: dict, record: dict) -> str:
    """The other speedup of the same run (all reach beside first done, or the reverse), its spread and its γ, from
    the record: a row states both conventions of the one configuration it reports."""
    parent, _, name = exp["metric"].rpartition(".")
    if name not in COMPANION:
        return ""
    other, label = COMPANION[name]
    path = f"{parent}.{other}" if parent else other
    value = value_of(record, path)
    if not isinstance(value, (int, float)) or f"{value:.3f}" == f"{value_of(record, exp['metric']):.3f}":
        return ""  # one sequence: the first to finish is every sequence
    rounds = metric(record, path + "_rounds")
    text = f"{label} {value:.3f}×"
    if isinstance(rounds, list) and len(rounds) >= 3:
        text += f" [{min(rounds):.3f}–{max(rounds):.3f}]"
    gamma = metric(record, f"{parent}.gamma" if parent else "gamma")
    return text + (f" (γ {gamma})" if isinstance(gamma, int) else "")


def filled(text: str, record: dict, root: Path | None = None) -> str:
    """An experiment's free text with each {dotted.path:format} replaced by the record's value there, and each
    {FILE.json#dotted.path:format} by that committed JSON file's (relative to the repository, `root`); "not
    recorded" where there is none: a figure in a label is read from a record, never typed."""
    def one(m):
        source = record
        if m.group(1):
            try:
                source = json.loads(((root or Path.cwd()) / m.group(1)).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return "not recorded"
        value = metric(source, m.group(2))
        return "not recorded" if value is None else format(value, m.group(3) or "")
    return re.sub(r"\{(?:([\w./-]+\.json)#)?([\w.\"-]+)(?::([^}]*))?\}", one, text)


def table(experiments: list[dict]) -> str:
    """The README's headline table: one row per experiment, its value from the record it cites, the spread of its
    interleaved rounds, what differs from the paper's run (device, weights, acceptance, decoding, tokens), our own
    prediction where we have one, and how to rerun it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for exp in experiments:
        value, record = cited(exp)  # there, holding its number: check_cited
        link = f"[{exp['path'].stem}]({exp['path'].as_posix()})"
        link += f", [details]({exp['details']})" if exp.get("details") else ""
        env = record.get("environment") or {}
        count, _, _ = exp["device"].rpartition(" x ")
        device = (f"{count} × " if count else "") + (env.get("gpu") or exp["device"])
        kind = "first done" if exp["metric"].endswith("first_done") else ""
        ours = f"**{value:.3f}×**" + (f" {kind}" if kind else "")
        root = Path(exp["path"]).resolve().parent.parent
        ours += "".join(f"; {part}" for part in (companion(exp, record), filled(exp.get("also", ""), record, root))
                        if part)
        check = verdict(exp, value)[1].split(":")[0]
        check = f"{check} (± {exp['tolerance']:.0%} of {exp['expected']})" + rerun(exp, record)
        cells = [ours, spread(exp, record), device, weights(record), acceptance(exp, record),
                 decoding(exp, record), filled(exp.get("prediction", "—"), record, root), check]
        lines.append("| " + " | ".join([exp["claim"], exp.get("paper", "—"), *cells, link]) + " |")
    return "\n".join(lines)


def write_table(readme: Path, experiments: list[dict]) -> None:
    if not experiments:
        raise MagicDecError("no experiment files (experiments/*.toml) to write the table from: run it from the "
                            "repository's root, or name the files")
    try:
        text = readme.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MagicDecError(f"--readme {readme} does not exist: run from the repository's root (its README.md), or "
                            "give --readme PATH") from None
    except (OSError, UnicodeDecodeError) as e:
        why = "it is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e))
        raise MagicDecError(f"--readme {readme}: cannot read it ({why}); give the UTF-8 README.md whose headline "
                            "table to write") from None
    start, end = README_MARKERS
    if start not in text or end not in text:
        raise MagicDecError(f"{readme} has no headline-table markers ({start} ... {end}): add them where the table goes")
    check_cited(experiments)
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    write_text(readme, f"{head}{start}\n{table(experiments)}\n{end}{tail}", "--readme")
    print(f"wrote the headline table of {readme} ({len(experiments)} experiments)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="magicdec reproduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiments", type=Path, nargs="*", help="experiment files (default with --table: experiments/)")
    p.add_argument("--output", type=Path, default=None, help="where the rerun's record goes (one experiment)")
    p.add_argument("--output_dir", type=Path, default=None,
                   help="rerun every experiment named (default: experiments/*.toml) of this machine's device class, "
                        "each record to DIR/NAME.json; the others are listed as skipped, with the class they need")
    p.add_argument("--anywhere", action="store_true",
                   help="run on a device of another class than the experiment's, for a look: the value is printed and "
                        "recorded as not comparable, with no PASS or FAIL; without CUDA on the CPU with eager steps")
    p.add_argument("--table", action="store_true", help="write the README's headline table instead of running")
    p.add_argument("--readme", type=Path, default=Path("README.md"), help="the README whose table --table writes")
    a = p.parse_args(argv)
    if a.table:
        files = a.experiments or sorted(Path("experiments").glob("*.toml"))
        write_table(a.readme, sorted((load(f) for f in files), key=lambda e: (e.get("order", 100), e["path"].name)))
        return 0
    if a.output_dir:
        return reproduce_all(a.experiments or sorted(Path("experiments").glob("*.toml")), a.output_dir)
    if not a.experiments:
        raise MagicDecError("name an experiment file (experiments/*.toml), or pass --table or --output_dir")
    if a.output and len(a.experiments) > 1:
        raise MagicDecError("--output names one record: run one experiment at a time")
    experiments = [load(f) for f in a.experiments]  # every file checked before anything runs
    results = [reproduce(exp, a.output, a.anywhere)[0] for exp in experiments]
    return 0 if all(results) else 1


if __name__ == "__main__":
    from magicdec.errors import one_line_errors

    with one_line_errors():
        raise SystemExit(main())
