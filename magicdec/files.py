"""Durable writes of what a person keeps (records, pages, figures, checkpoints, datastores, converted models): each
is written whole to a uniquely named temporary file beside it, flushed to disk and renamed into place, so a kill, a
full disk or a second writer never leaves half a file where a whole one (or none) was. A write that fails removes
its temporary file and says in one line what it could not write, why (disk full, read-only, permission) and the fix.

Temporary names are `.NAME.PID.RANDOM.tmp` (hidden, and never matching the `*.json` a sweep or report reads); one
left by a process that no longer runs (killed mid-write) is removed the next time NAME is written.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from magicdec.errors import MagicDecError

CAUSES = {  # errno -> (what happened, what to do)
    errno.ENOSPC: ("the disk is full", "free space there or choose a folder on another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free space there or choose a folder on another disk"),
    errno.EFBIG: ("the file is larger than this process may write", "raise the file size limit (ulimit -f)"),
    errno.EROFS: ("the file system is read-only", "choose a folder on a writable disk"),
    errno.EACCES: ("permission denied", "choose a folder you can write to, or change its permissions"),
    errno.EPERM: ("permission denied", "choose a folder you can write to, or change its permissions"),
    errno.ENOTDIR: ("a file is in the way of its folder", "choose another path"),
    errno.EISDIR: ("it is a folder", "name a file"),
}
_live: set[Path] = set()  # this process's temporary files and folders while they are being written


def cannot_write(path, e: OSError, what: str = "") -> MagicDecError:
    """The one-line error for an OSError met writing `path` (`what`: the flag that named it, e.g. "--output")."""
    cause, fix = CAUSES.get(e.errno, (e.strerror or str(e), "choose another path"))
    return MagicDecError(f"{what + ' ' if what else ''}cannot write {path}: {cause}; {fix}")


def writable_folder(folder, what: str) -> None:
    """Make `folder` (and its parents) and prove a file can be written there, or say why not in one line: checked
    before the work whose result goes there."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_check_"):
            pass
    except OSError as e:
        cause, fix = CAUSES.get(e.errno, (e.strerror or str(e), "choose a folder you can write to"))
        raise MagicDecError(f"{what}: cannot write to {folder} ({cause}); {fix}") from None
    if not os.access(folder, os.W_OK):
        raise MagicDecError(f"{what}: cannot write to {folder} (permission denied); choose a folder you can write to")


# --- temporary names ------------------------------------------------------------------------------------------------
def temp_path(path: Path) -> Path:
    """A name beside `path` no other process or write uses: .NAME.PID.RANDOM.tmp."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _stale_names(name: str) -> re.Pattern:
    # this module's names, and the older `NAME.PID.tmp` that train_head and the checkpoint cache used
    return re.compile(rf"\.?{re.escape(name)}\.(\d+)(?:\.[0-9a-f]{{8}})?\.(?:tmp|old)")


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours are in _live; any other with our pid is from an earlier process that had it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_stale(path: Path) -> list[Path]:
    """Remove the temporary files or folders of `path` left by processes that no longer run; returns them."""
    path, removed = Path(path), []
    pattern = _stale_names(path.name)
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        p = Path(entry.path)
        if m and p not in _live and not _running(int(m.group(1))):
            discard(p)
            removed.append(p)
    return removed


def discard(path: Path) -> None:
    """Remove a temporary file or folder, whatever it is; never raises (it runs while another error unwinds)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


# --- whole files ----------------------------------------------------------------------------------------------------
def write(path, fill: Callable, what: str = "") -> Path:
    """`fill(f)` writes the file's bytes to the open file object f; the result is at `path` whole, or `path` is as
    it was. An OSError (disk full, read-only, permission) is a one-line MagicDecError; any failure, a Ctrl-C or a
    SIGTERM included, removes the temporary file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        with temporary(path) as tmp:
            with open(tmp, "xb") as f:  # exclusive: a name no one else uses
                fill(f)
                f.flush()
                os.fsync(f.fileno())  # on disk before the name points at it: a crash after the rename keeps it whole
            os.replace(tmp, path)
    except Exception as e:
        error = _os_error(e)
        if error is not None:
            raise cannot_write(path, error, what) from None
        raise
    _sync_folder(path.parent)
    return path


@contextmanager
def temporary(path):
    """A temporary name beside `path` (temp_path), this process's while the block runs (remove_stale leaves it), and
    removed after the block, whatever ends it (what the block renamed into place is no longer there to remove)."""
    tmp = temp_path(Path(path))
    _live.add(tmp)
    try:
        yield tmp
    finally:
        discard(tmp)
        _live.discard(tmp)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a library's own error (torch.save reports a failed write as a RuntimeError)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _sync_folder(folder: Path) -> None:
    """The rename itself on disk (best effort: not every file system lets a folder be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path, data: bytes, what: str = "") -> Path:
    return write(path, lambda f: f.write(data), what)


def write_text(path, text: str, what: str = "") -> Path:
    return write_bytes(path, text.encode("utf-8"), what)


def write_json(path, obj, what: str = "", indent: int = 1, default=str) -> Path:
    return write_text(path, json.dumps(obj, indent=indent, default=default), what)


def save_torch(path, obj, what: str = "") -> Path:
    import torch

    return write(path, lambda f: torch.save(obj, f), what)


def save_npz(path, what: str = "", **arrays) -> Path:
    """np.savez to exactly `path` (given a file name, np.savez would add .npz to it)."""
    import numpy as np

    return write(path, lambda f: np.savez(f, **arrays), what)


def save_figure(path, fig, what: str = "", **savefig) -> Path:
    """A matplotlib figure in the format its suffix names (png, pdf, svg)."""
    path = Path(path)
    return write(path, lambda f: fig.savefig(f, format=path.suffix.lstrip(".") or "png", **savefig), what)


# --- several files that belong together ------------------------------------------------------------------------------
@contextmanager
def files_into(folder, last: str, what: str = ""):
    """A temporary folder (inside `folder`, made if missing) to write a set of files into; when the block ends
    without error they move into `folder`, `last` (the file whose presence says the set is whole, e.g. model.pth)
    removed first and moved in last, so that at no moment does `folder` hold `last` beside a partial set. On any
    failure the temporary folder goes and `folder` keeps what it had. Other files in `folder` are left alone."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale(folder / "partial")
        with temporary(folder / "partial") as stage:
            stage.mkdir()
            yield stage
            names = sorted(p.name for p in stage.iterdir())
            if last not in names:
                raise RuntimeError(f"{last} was not written")  # a bug in the writer, not the user's
            for name in names:  # on disk before any name points at them
                if (stage / name).is_file():
                    with open(stage / name, "rb") as f:
                        os.fsync(f.fileno())
            (folder / last).unlink(missing_ok=True)
            for name in [n for n in names if n != last] + [last]:
                os.replace(stage / name, folder / name)
        _sync_folder(folder)
    except OSError as e:
        raise cannot_write(folder, e, what) from None


# --- one writer at a time -------------------------------------------------------------------------------------------
@contextmanager
def locked(lock, busy: Callable[[str], str] | None = None):
    """Hold an exclusive lock (flock) on the file `lock` for the block; it holds this process's pid and is removed
    after. `busy` given: if another process holds it, raise MagicDecError(busy(its pid)) at once; else wait for it.
    A lock is let go when its process ends, however it ends: a killed holder never blocks the next writer."""
    lock = Path(lock)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise cannot_write(lock, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if busy else 0))
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise MagicDecError(busy(holder)) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the last holder may have removed the file between our open and our lock: lock the one there now
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            lock.unlink(missing_ok=True)  # while still holding it: a waiter that then locks it sees it gone
        except OSError:
            pass
        os.close(fd)


def write_record(path: Path | None, record: dict) -> None:
    """A run's record at `path`, written whole or not at all (write_json). Where it cannot be written (a disk that
    filled during the run), the measurement is not lost: it goes to the system's temporary folder (or, failing that,
    to stdout) and the one-line error names where."""
    if path is None:
        return
    try:
        write_json(path, record)
    except MagicDecError as e:
        kept = Path(tempfile.gettempdir()) / f"magicdec-record-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        try:
            write_json(kept, record)
            where = f"the record is kept in {kept}: move it to {path} once there is room"
        except MagicDecError:
            print(json.dumps(record, indent=1, default=str))
            where = "the record is printed above (the temporary folder could not take it either)"
        raise MagicDecError(f"{e}; {where}") from None
    print(f"wrote {path}")
