"""One exception type for bad input: the command-line entry points print its message on one line and exit 2. Ctrl-C
and SIGTERM end a command the same way: one line (what was kept, how to go on), exit 130 or 143."""
import importlib
import importlib.util
import re
import signal
import sys
import threading
from contextlib import contextmanager


class MagicDecError(Exception):
    """A problem with the user's input or environment, with a message that names the fix."""


# The optional kernel libraries, each imported only in the function that runs it (`require`), so that every command
# and every drafter works on the runtime requirements alone; the install line its error names.
INSTALL = {
    "triton": "pip install triton (CUDA builds of torch bring it; a CPU install has none)",
    "gemlite": "pip install gemlite (its Triton kernels run the 8- and 4-bit draft weights on a GPU)",
    "flash_attn": "pip install flash-attn (its decode kernel, on a CUDA device)",
}


def installed(library: str) -> bool:
    """Whether an optional library can be imported, without importing it."""
    return importlib.util.find_spec(library) is not None


def require(module: str, needed_for: str):
    """`module` imported where it is used: an optional kernel library, or one of ours that imports one at its top (the
    Triton kernels). A missing library is one line naming what needed it and its install; any other failure to
    import is a bug, raised as it is."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        library = (e.name or "").split(".")[0]
        if library not in INSTALL:
            raise
        raise MagicDecError(f"{needed_for} needs {library}, which is not installed: {INSTALL[library]}") from None


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it unwinds as Ctrl-C does: temporary files removed, finished
    work kept on disk."""


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


@contextmanager
def interrupted_as(line):
    """A Ctrl-C or SIGTERM in the block ends the command with `line()` (what was kept, how to go on) as its one line,
    rather than the entry point's default."""
    try:
        yield
    except KeyboardInterrupt as e:
        if not e.args:
            e.args = (line(),)
        raise


def out_of_memory(e: BaseException) -> bool:
    """Host or device memory ran out (torch.OutOfMemoryError is no MemoryError): the memory check, an estimate, let
    through a run that did not fit."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"


@contextmanager
def one_line_errors(interrupted: str = "interrupted", rename: dict | None = None):
    """Turn MagicDecError into `error: <message>` and exit status 2, and Ctrl-C (exit 130) or SIGTERM (exit 143)
    into one line, with no traceback: the line an `interrupted_as` block gave, else `interrupted` (what to do about
    it). `rename` maps flags to the names a script's user types (TriForce's --prefill for --prefix_len)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    try:
        yield
    except MagicDecError as e:
        message = str(e)
        for ours, theirs in (rename or {}).items():
            message = re.sub(rf"{re.escape(ours)}(?![\w-])", theirs, message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if not out_of_memory(e):
            raise
        said = str(e).split(". ")[0] or type(e).__name__
        print(f"error: out of memory ({said}) although the memory estimate let this size through: lower --B or "
              "--prefix_len, or run on more tensor-parallel ranks or a device with more memory", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        print(f"\n{e.args[0] if e.args else interrupted}", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
