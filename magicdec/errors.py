"""One exception type for bad input: the command-line entry points print its message on one line and exit 2."""
import re
import sys
from contextlib import contextmanager


class MagicDecError(Exception):
    """A problem with the user's input or environment, with a message that names the fix."""


@contextmanager
def one_line_errors(interrupted: str = "interrupted", rename: dict | None = None):
    """Turn MagicDecError into `error: <message>` and exit status 2, and Ctrl-C into one line (`interrupted`: what
    to do about it) and exit status 130, with no traceback. `rename` maps flags to the names a script's user types
    (TriForce's --prefill for --prefix_len)."""
    try:
        yield
    except MagicDecError as e:
        message = str(e)
        for ours, theirs in (rename or {}).items():
            message = re.sub(rf"{re.escape(ours)}(?![\w-])", theirs, message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr)
        sys.exit(130)
