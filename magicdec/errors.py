"""One exception type for bad input: the command-line entry points print its message on one line and exit 2."""
import sys
from contextlib import contextmanager


class MagicDecError(Exception):
    """A problem with the user's input or environment, with a message that names the fix."""


@contextmanager
def one_line_errors():
    """Turn MagicDecError into `error: <message>` and exit status 2, with no traceback."""
    try:
        yield
    except MagicDecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
