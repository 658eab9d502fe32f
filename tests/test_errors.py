"""How a command ends (magicdec/errors.py): bad input as one `error:` line (exit 2); Ctrl-C (exit 130) and SIGTERM
(exit 143) as one line saying what was kept and how to go on, after the files being written are cleaned up: a real
signal sent to a process at a chosen point, and every command's entry point handling SIGTERM.

`terminated_at` is what the other test files use to SIGTERM a command at a point of its work."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO
from magicdec import cli, errors
from magicdec.errors import _terminate

PRELUDE = """
import runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as a terminal gives it: a background job's
# parent (a CI script started with &) leaves SIGINT ignored, and Python then never raises KeyboardInterrupt

def reached():  # the point to be signalled: say so, then wait for the signal
    print("reached", flush=True)
    time.sleep(120)

"""


CLI = "\nfrom magicdec.cli import main\nsys.exit(main(sys.argv[1:]))\n"  # `magicdec ARGV`


def as_script(path) -> str:
    """`python PATH ARGV`."""
    return f"\nsys.argv = [{str(path)!r}] + sys.argv[1:]\nrunpy.run_path({str(path)!r}, run_name='__main__')\n"


def terminated_at(code: str, argv=(), sig: int = signal.SIGTERM, cwd=REPO) -> subprocess.CompletedProcess:
    """Run `code` (after PRELUDE; e.g. a patch making a call of a command call reached(), then CLI) with `argv` in a
    process, and send it `sig` once it reaches reached(). Returns the finished process (stdout, stderr as text)."""
    p = subprocess.Popen([sys.executable, "-c", PRELUDE + code, *map(str, argv)], cwd=cwd, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.strip() == "reached":
            break
    else:
        out, err = p.communicate()
        pytest.fail(f"never reached the point to signal (rc {p.returncode}):\n{''.join(lines)}{out}{err[-3000:]}")
    p.send_signal(sig)
    out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, "".join(lines) + out, err)


def ended_with(p: subprocess.CompletedProcess, status: int, *needles: str) -> str:
    """The process ended with `status` and one line on stderr (after any progress output) naming every needle."""
    assert p.returncode == status, f"rc {p.returncode}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert lines and lines[-1].startswith("interrupted") and sum(x.startswith("interrupted") for x in lines) == 1, \
        p.stderr
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


SLEEPER = """
from magicdec.errors import interrupted_as, one_line_errors
with one_line_errors("interrupted: the default line"):
    with interrupted_as(lambda: "interrupted: 3 of 10 points done; run the same command again"):
        reached()
"""


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_with_the_line_of_what_was_kept(sig, status):
    p = terminated_at(SLEEPER, sig=sig)
    assert ended_with(p, status) == "interrupted: 3 of 10 points done; run the same command again"


COMMAND_MAINS = {"compare": "magicdec.harness.compare", "sweep": "magicdec.harness.sweep", "report": "magicdec.harness.report",
                 "reproduce": "magicdec.harness.reproduce", "datastore": "magicdec.drafters.datastore",
                 "train-head": "magicdec.harness.train_head"}


@pytest.mark.parametrize("command", ["run", *COMMAND_MAINS])
def test_every_command_handles_sigterm_while_it_works_and_restores_the_handler(command, monkeypatch):
    """While a command runs, SIGTERM raises where the work is (errors.Terminated, a KeyboardInterrupt), so it ends as
    Ctrl-C does: finally blocks run, temporary files go. After it, the handler that was there is back."""
    import importlib

    seen = []
    if command == "run":
        import magicdec.harness.run

        monkeypatch.setattr(magicdec.harness.run, "run", lambda cfg: seen.append(signal.getsignal(signal.SIGTERM)))
        argv = ["run", "--random_weights", "--model_name", "JackFram/llama-68m", "--device", "cpu"]
    else:
        module = importlib.import_module(COMMAND_MAINS[command])
        monkeypatch.setattr(module, "main", lambda argv: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
        argv = [command]
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(argv) == 0
    assert seen == [_terminate] and signal.getsignal(signal.SIGTERM) is before


def test_conversion_handles_sigterm():
    """convert_hf_checkpoint.py is its own entry point: the same handler while it converts."""
    p = subprocess.run([sys.executable, "-c", "import runpy, signal, sys\n"
                        "import magicdec.model.checkpoint as c\n"
                        "from magicdec.errors import _terminate\n"
                        "c.convert_hf_checkpoint = lambda d, dtype=None: print(signal.getsignal(signal.SIGTERM) is "
                        "_terminate) or 'x'\n"
                        "sys.argv = ['convert_hf_checkpoint.py', '--checkpoint_dir', '.']\n"
                        "runpy.run_path('convert_hf_checkpoint.py', run_name='__main__')"],
                       cwd=REPO, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.returncode == 0 and p.stdout.splitlines()[0] == "True", p.stderr


def test_out_of_memory_is_one_line_naming_the_fix(capsys):
    """A device that runs out of memory past the memory check (torch.OutOfMemoryError, a RuntimeError): one line,
    exit 1; any other RuntimeError keeps its traceback."""
    import torch

    with pytest.raises(SystemExit) as e, errors.one_line_errors():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has ...")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1
    assert err[0].startswith("error: out of memory (CUDA out of memory) ") and "lower --B or --prefix_len" in err[0]
    with pytest.raises(RuntimeError, match="not memory"), errors.one_line_errors():
        raise RuntimeError("not memory")


# Every module of the package imported, then every command's --help, with the optional kernel libraries made
# unimportable (None in sys.modules stops an import as a missing package does): only the Triton kernels' own modules,
# which the code imports through errors.require, may need one.
WITHOUT_KERNELS = """
import contextlib, importlib, io, pkgutil, sys
for library in {libraries!r}:
    sys.modules[library] = None
import magicdec
from magicdec import cli
failed = {{}}
for info in pkgutil.walk_packages(magicdec.__path__, "magicdec."):
    if info.name == "magicdec.__main__":  # runs the command
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as e:
        failed[info.name] = e.name
print("FAILED", sorted(failed.items()))
for command in cli.COMMANDS:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            cli.main([command, "--help"])
        except SystemExit as e:
            assert not e.code, (command, e.code)
    assert "usage:" in out.getvalue(), command
    print("HELP", command)
"""


def test_every_module_and_every_help_work_without_the_optional_kernel_libraries():
    p = subprocess.run([sys.executable, "-c", WITHOUT_KERNELS.format(libraries=sorted(errors.INSTALL))],
                       capture_output=True, text=True, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    failed = eval(p.stdout.split("FAILED ", 1)[1].splitlines()[0])
    assert failed and all(module.startswith("magicdec.model.triton_") and library == "triton" for module, library in failed)
    assert [line[5:] for line in p.stdout.splitlines() if line.startswith("HELP ")] == list(cli.COMMANDS)


def test_a_missing_kernel_library_is_one_line_naming_its_install(monkeypatch):
    import torch

    from magicdec.model import attention, fused
    from magicdec.model.transformer import add_rms_norm


    monkeypatch.setitem(sys.modules, "triton", None)
    for kernels in ("magicdec.model.triton_attention", "magicdec.model.triton_norm", "magicdec.model.triton_quant_kv"):
        monkeypatch.delitem(sys.modules, kernels, raising=False)
    monkeypatch.setitem(sys.modules, "gemlite", None)
    with pytest.raises(errors.MagicDecError, match=r"^--attn_backend triton needs triton, which is not installed: "
                                                    r"pip install triton \("):
        attention.make_attend("triton", torch.zeros(1, 1, dtype=torch.long), None, 8)
    with pytest.raises(errors.MagicDecError, match=r"^--draft_weights on a GPU needs gemlite, .*: pip install gemlite"):
        errors.require("gemlite", "--draft_weights on a GPU")
    monkeypatch.setattr(fused, "_fusing", True)
    with pytest.raises(errors.MagicDecError, match="fused kernels on a GPU .* needs triton"):
        fused._fused(f"{add_rms_norm.__module__}.{add_rms_norm.__qualname__}")


def test_require_raises_a_bug_in_an_import_as_it_is(tmp_path, monkeypatch):
    (tmp_path / "broken_module.py").write_text("import a_module_that_is_not_a_kernel_library\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="a_module_that_is_not_a_kernel_library"):
        errors.require("broken_module", "this test")
