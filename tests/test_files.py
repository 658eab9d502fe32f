"""Durable writes (magicdec/files.py), each fault injected: a disk that fills in the middle of a write, a read-only
folder, a permission denied, a Ctrl-C or an exception in the middle of a write, a writer SIGKILLed mid-write (its
temporary file removed by the next write), a set of files interrupted before it is whole, two processes taking one
lock. After each, the file is whole (the new one) or as it was, never partial, and no temporary file is left.

The faults are injected by patching the calls a write makes (`faulty_disk`), so they act the same for root (where
chmod stops nothing) and on any file system; a control shows each injected fault does cut a plain write short.
Other test files import `faulty_disk` to inject the same faults into the commands that write."""
from __future__ import annotations

import builtins
import errno
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from magicdec import files
from magicdec.errors import MagicDecError


class FaultyFile:
    """A file open for writing on a disk with `room` bytes left: what fits is written, then `err` (ENOSPC)."""

    def __init__(self, f, room: int, err: int):
        self.f, self.room, self.err, self.written = f, room, err, 0

    def write(self, data):
        data = memoryview(data).cast("B") if not isinstance(data, str) else data
        n = len(data)
        if self.written + n > self.room:
            fits = max(self.room - self.written, 0)
            self.f.write(data[:fits])
            self.written += fits
            self.f.flush()
            raise OSError(self.err, os.strerror(self.err))
        self.written += n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def faulty_disk(monkeypatch, folder, err: int, room: int | None = None) -> None:
    """Writes under `folder` fail with errno `err` as a disk there would: `room` None, at making a file or folder (a
    read-only file system, a permission denied); else once `room` more bytes are written to a file (a full disk:
    files are still made, as a 0-byte writability check is)."""
    folder = Path(os.path.abspath(folder))
    under = lambda p: isinstance(p, (str, os.PathLike)) and Path(os.path.abspath(p)).is_relative_to(folder)  # noqa
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def fail(path):
        raise OSError(err, os.strerror(err), str(path))

    def open_(file, mode="r", *args, **kw):
        if under(file) and any(c in mode for c in "wxa+"):
            if room is None:
                fail(file)
            return FaultyFile(real_open(file, mode, *args, **kw), room, err)
        return real_open(file, mode, *args, **kw)

    def os_open(path, flags, *args, **kw):
        if room is None and under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            fail(path)
        return real_os_open(path, flags, *args, **kw)

    def mkdir(path, *args, **kw):
        if room is None and under(path) and not os.path.exists(path):
            fail(path)
        return real_mkdir(path, *args, **kw)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).rglob("*") if p.name.endswith(".tmp"))


WRITERS = {  # name -> (file name, write it with magicdec.files, read it back)
    "text": ("page.md", lambda p, v: files.write_text(p, f"# page {v}\n" + "é" * 5000), lambda p: p.read_text()),
    "json": ("record.json", lambda p, v: files.write_json(p, {"v": v, "rows": list(range(3000))}),
             lambda p: json.loads(p.read_text())["v"]),
    "torch": ("state.pt", lambda p, v: files.save_torch(p, {"v": torch.full((4000,), float(v))}),
              lambda p: torch.load(p, weights_only=True)["v"][0].item()),
    "numpy": ("store.npz", lambda p, v: files.save_npz(p, v=np.full(4000, v)), lambda p: np.load(p)["v"][0]),
    "figure": ("plot.png", lambda p, v: files.save_figure(p, figure(v)), lambda p: p.read_bytes()),
}


def figure(v):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 2))
    fig.gca().plot([0, 1], [0, v])
    return fig


@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_disk_that_fills_mid_write_leaves_the_old_file_whole_and_no_temporary(kind, tmp_path, monkeypatch):
    name, write, read = WRITERS[kind]
    path = tmp_path / name
    write(path, 1)
    old, old_bytes = read(path), path.read_bytes()
    with monkeypatch.context() as m:
        faulty_disk(m, tmp_path, errno.ENOSPC, room=200)
        with pytest.raises(MagicDecError) as e:
            write(path, 2)
    assert str(e.value) == f"cannot write {path}: the disk is full; free space there or choose a folder on another disk"
    assert path.read_bytes() == old_bytes and read(path) == old and temporaries(tmp_path) == []
    write(path, 3)  # the disk has room again
    assert read(path) != old and temporaries(tmp_path) == []


def test_the_injected_full_disk_cuts_a_plain_write_short(tmp_path, monkeypatch):
    """The control: the same fault on a write in place (what the commands did) leaves a partial file."""
    path = tmp_path / "page.md"
    path.write_text("# a whole page\n" * 100)
    faulty_disk(monkeypatch, tmp_path, errno.ENOSPC, room=200)
    with pytest.raises(OSError):
        path.write_text("# a new page\n" * 100)
    assert len(path.read_bytes()) == 200


@pytest.mark.parametrize("err, cause", [
    (errno.EROFS, "the file system is read-only; choose a folder on a writable disk"),
    (errno.EACCES, "permission denied; choose a folder you can write to")])
def test_a_read_only_or_forbidden_folder_is_one_line_naming_cause_and_fix(err, cause, tmp_path, monkeypatch):
    path = tmp_path / "out" / "record.json"
    faulty_disk(monkeypatch, tmp_path / "out", err)
    with pytest.raises(MagicDecError) as e:
        files.write_json(path, {"a": 1}, "--output")
    assert str(e.value).startswith(f"--output cannot write {path}: {cause}") and "\n" not in str(e.value)
    with pytest.raises(MagicDecError) as e:
        files.writable_folder(tmp_path / "out", "--output")
    assert str(e.value).startswith(f"--output: cannot write to {tmp_path / 'out'} ({cause.split(';')[0]})")
    assert not path.exists()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_an_interruption_mid_write_keeps_the_old_file_and_removes_the_temporary(stop, tmp_path):
    path = tmp_path / "record.json"
    files.write_json(path, {"v": 1})

    def half_then_stop(f):
        f.write(b'{"v": 2, "rows": [')
        raise stop()

    with pytest.raises(stop):
        files.write(path, half_then_stop)
    assert json.loads(path.read_text()) == {"v": 1} and temporaries(tmp_path) == []


WRITER = """
import sys, time
from pathlib import Path
from magicdec import files
def slow(f):
    f.write(b'{"v": 2, "rows": [' + b'0, ' * 100000)
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
files.write(Path(sys.argv[1]), slow)
"""


def killed_mid_write(path: Path, sig: int) -> subprocess.CompletedProcess:
    """A process writing `path` through files.write, sent `sig` once it is halfway through its write."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                         env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(sig)
    p.wait()
    return p


def test_a_writer_killed_mid_write_leaves_the_old_file_and_the_next_write_removes_its_temporary(tmp_path):
    path = tmp_path / "record.json"
    files.write_json(path, {"v": 1})
    p = killed_mid_write(path, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    assert json.loads(path.read_text()) == {"v": 1}
    (left,) = temporaries(tmp_path)  # a kill runs no cleanup: its partial temporary stays, under a name no one uses
    assert left.startswith(f".record.json.{p.pid}.") and (tmp_path / left).stat().st_size > 100000
    files.write_json(path, {"v": 3})
    assert json.loads(path.read_text()) == {"v": 3} and temporaries(tmp_path) == []  # its process is gone


def test_the_temporary_of_a_running_writer_is_left_alone(tmp_path):
    path = tmp_path / "record.json"
    other = files.temp_path(path).name.replace(f".{os.getpid()}.", f".{os.getppid()}.")  # a live process's
    (tmp_path / other).write_text("in progress")
    legacy_dead = tmp_path / f"record.json.{dead_pid()}.tmp"  # the name train-head and conversions used to use
    legacy_dead.write_text("left by a killed run")
    files.write_json(path, {"v": 1})
    assert temporaries(tmp_path) == [other]
    assert files.temp_path(path) != files.temp_path(path)  # unique within one process too


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def test_sigterm_mid_write_under_one_line_errors_is_one_line_and_leaves_nothing(tmp_path):
    path = tmp_path / "record.json"
    files.write_json(path, {"v": 1})
    script = WRITER.replace("files.write(Path(sys.argv[1]), slow)", "from magicdec.errors import one_line_errors\n"
                            "with one_line_errors('interrupted: nothing written'):\n"
                            "    files.write(Path(sys.argv[1]), slow)")
    p = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "writing"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate()
    assert p.returncode == 143 and err.strip() == "interrupted: nothing written"
    assert json.loads(path.read_text()) == {"v": 1} and temporaries(tmp_path) == []


def test_a_set_of_files_is_installed_whole_or_not_at_all(tmp_path):
    """A conversion's config.json, tokenizer and model.pth: interrupted while writing, the folder keeps the old set
    (never a new config beside an old model); finished, the new set, model.pth last; no staging folder left."""
    out = tmp_path / "model"
    with files.files_into(out, "model.pth") as stage:
        (stage / "config.json").write_text("old")
        (stage / "model.pth").write_text("old weights")
    with pytest.raises(KeyboardInterrupt):
        with files.files_into(out, "model.pth") as stage:
            (stage / "config.json").write_text("new")
            raise KeyboardInterrupt
    assert {p.name: p.read_text() for p in out.iterdir()} == {"config.json": "old", "model.pth": "old weights"}
    stale = out / f".partial.{dead_pid()}.0123abcd.tmp"  # a killed process's staging folder
    stale.mkdir()
    (stale / "model.pth").write_text("x" * 1000)
    order = []
    real = os.replace
    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "replace", lambda a, b: (order.append(Path(b).name), real(a, b)))
        with files.files_into(out, "model.pth") as stage:
            for name in ("model.pth", "config.json", "tokenizer.json"):
                (stage / name).write_text(f"new {name}")
    assert order == ["config.json", "tokenizer.json", "model.pth"]
    assert {p.name: p.read_text() for p in out.iterdir()} == {n: f"new {n}" for n in order}


def test_a_set_on_a_full_disk_is_one_line_and_leaves_the_old_set(tmp_path, monkeypatch):
    out = tmp_path / "model"
    with files.files_into(out, "model.pth") as stage:
        (stage / "model.pth").write_text("old weights")
    faulty_disk(monkeypatch, out, errno.ENOSPC, room=10)
    with pytest.raises(MagicDecError, match=f"--checkpoint_dir cannot write {out}: the disk is full"):
        with files.files_into(out, "model.pth", "--checkpoint_dir") as stage:
            (stage / "model.pth").write_text("new weights, longer than the room left")
    assert [p.name for p in out.iterdir()] == ["model.pth"] and (out / "model.pth").read_text() == "old weights"


HOLDER = """
import sys
from pathlib import Path
from magicdec import files
with files.locked(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()  # held until the test says go (a timer would let go early on a busy machine)
    Path(sys.argv[1]).with_name("done").touch()  # still holding it
"""


def test_a_lock_held_by_another_process_is_refused_naming_it_or_waited_for(tmp_path):
    lock = tmp_path / ".lock"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(MagicDecError, match=f"^busy: pid {p.pid}$"):
        with files.locked(lock, lambda pid: f"busy: pid {pid}"):
            pass
    p.stdin.write("go\n")
    p.stdin.flush()
    with files.locked(lock):  # waits for the holder to let go
        assert (tmp_path / "done").exists() and lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists() and p.wait() == 0


COUNTER = """
import sys
from pathlib import Path
from magicdec import files
path = Path(sys.argv[1])
for _ in range(30):
    with files.locked(path.with_name(".count.lock")):
        files.write_text(path, str(int(path.read_text()) + 1))
"""


def test_two_processes_updating_one_file_under_its_lock_lose_no_update(tmp_path):
    """Read, add one, write: 30 times in each of two processes at once. Without the lock updates are lost (both
    read the same count); with it, the count is 60."""
    path = tmp_path / "count"
    path.write_text("0")
    procs = [subprocess.Popen([sys.executable, "-c", COUNTER, str(path)], cwd=REPO,
                              env=os.environ | {"PYTHONPATH": str(REPO)}) for _ in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    assert path.read_text() == "60" and sorted(p.name for p in tmp_path.iterdir()) == ["count"]


def test_a_killed_lock_holder_never_blocks_the_next(tmp_path):
    lock = tmp_path / ".lock"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "held"
    p.kill()
    p.wait()
    with files.locked(lock, lambda pid: f"busy: pid {pid}"):  # taken at once: a lock goes with its process
        assert lock.read_text() == f"{os.getpid()}\n"
