"""Writing files and folders so that nothing a user has is lost or left half-written.

- Every temporary is named `.NAME.tmp<PID>` beside its target (`.NAME.old<PID>` for a target
  being swapped out), so the next start can tell a dead process's leftovers from a live one's and
  remove only those (`clean_stale`).
- Files and folders get the user's umask (safetensors and `tempfile` create 0600/0700 entries).
- A folder is replaced only when llmopt wrote it (it holds `MARKER`), never when it is the input of
  the same command; the swap of old and new is one atomic exchange where the kernel has one
  (Linux renameat2), else two renames whose leftover the next start puts back.
- SIGTERM is turned into an exception like Ctrl-C, so the same cleanup runs (`handle_sigterm`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from llmopt.errors import UserInputError

MARKER = "llmopt.json"   # written into every folder llmopt creates; what --overwrite may replace
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)(?P<pid>\d+)$")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so `finally` blocks and temp cleanup run."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def handle_sigterm() -> None:
    """Make SIGTERM raise `Terminated` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def raise_terminated(signum, _frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, raise_terminated)


# -- permissions ------------------------------------------------------------------------------------

def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give a file 0666 & ~umask and a folder (recursively) 0777 & ~umask, as `open`/`mkdir` would."""
    mask = current_umask()
    path = Path(path)
    if path.is_dir():
        os.chmod(path, 0o777 & ~mask)
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(root, f), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


# -- temporaries ------------------------------------------------------------------------------------

def temp_path(target: str | Path, kind: str = "tmp") -> Path:
    target = Path(target)
    return target.parent / f".{target.name}.{kind}{os.getpid()}"


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's live process
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def clean_stale(directory: str | Path) -> list[Path]:
    """Remove `.NAME.tmp<PID>` leftovers of processes that are gone (never a live one's). A
    `.NAME.old<PID>` whose NAME is missing is the user's data caught between two renames: it is put
    back; otherwise it is removed. Returns what was removed or restored."""
    directory = Path(directory)
    done: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return done
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m or pid_alive(int(m["pid"])):
            continue
        target = directory / m["name"]
        if m["kind"] == "old" and not target.exists():
            os.replace(p, target)
        else:
            _remove(p)
        done.append(p)
    return done


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write a file through `.NAME.tmp<PID>` and a rename: never half-written. The parent folder must
    exist (a mistyped folder is an error, not a new tree)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserInputError(f"cannot write {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise UserInputError(f"cannot write {path}: it is a folder")
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- output folders ---------------------------------------------------------------------------------

def _resolved(p: str | Path) -> Path:
    return Path(p).expanduser().resolve()


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def is_ours(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def write_marker(folder: str | Path, info: dict[str, Any]) -> None:
    write_atomic(Path(folder) / MARKER, json.dumps({"written_by": "llmopt", **info}, indent=2) + "\n")


def check_output_folder(output: str | Path, overwrite: bool, inputs: list[str | Path] = (),
                        flag: str = "--output") -> Path:
    """Refuse, before any work, an output folder that would lose data: the input itself (or a
    folder inside or around it), the working directory or one of its parents, an existing file,
    a non-empty folder without --overwrite, or one llmopt did not write. Returns the absolute path."""
    out = _resolved(output)
    for src in inputs:
        if src is not None and _overlaps(out, _resolved(src)):
            raise UserInputError(f"{flag} {output} is (or contains, or is inside) the input {src}: "
                                 "write the result to another folder")
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise UserInputError(f"{flag} {output} is the working directory or one of its parents: name a new folder")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserInputError(f"{flag} {output} exists and is not a folder: choose a folder name")
        if any(out.iterdir()):
            if not overwrite:
                raise UserInputError(f"{flag} {output} exists and is not empty: choose another folder "
                                     "or pass --overwrite")
            if not is_ours(out):
                raise UserInputError(f"{flag} {output} was not written by llmopt (no {MARKER}): refusing to "
                                     "replace it even with --overwrite; remove it yourself or choose another folder")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserInputError(f"{flag} {output}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or not _can_create(parent, out.name, is_folder=True):
        raise UserInputError(f"{flag} {output}: {parent} is not writable")
    return out


def _can_create(folder: Path, name: str, is_folder: bool) -> bool:
    """Whether a `.NAME.tmp<PID>` entry can really be made in `folder` (permissions, read-only or
    virtual file systems, root's quirks): made and removed at once."""
    probe = temp_path(folder / name)
    try:
        if is_folder:
            probe.mkdir()
            probe.rmdir()
        else:
            with open(probe, "xb"):
                pass
            probe.unlink()
    except FileExistsError:
        return True      # our own temporary is already there: the folder takes new entries
    except OSError:
        return False
    return True


def check_output_file(output: str | Path, inputs: list[str | Path] = (), flag: str = "--output") -> Path:
    """Refuse, before any work, a result file that cannot be written or would replace an input: a
    folder, a missing parent folder (not created: a typo is an error, not a new tree), an unwritable
    folder, or the same file as one of `inputs`. An existing result file is replaced. Returns the
    absolute path."""
    out = _resolved(output)
    for src in inputs:
        if src is not None and out == _resolved(src):
            raise UserInputError(f"{flag} {output} is the input {src}: write the result to another file")
    if out.is_dir():
        raise UserInputError(f"{flag} {output} is a folder: give a file name, e.g. {Path(output) / 'result.json'}")
    if not out.parent.is_dir():
        raise UserInputError(f"{flag} {output}: folder {out.parent} does not exist: create it first or fix the path")
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)) \
            or not _can_create(out.parent, out.name, is_folder=False):
        raise UserInputError(f"{flag} {output}: {out.parent if not out.exists() else out} is not writable")
    return out


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_libc = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    global _libc
    if not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange)
    return rc == 0


def replace_folder(new: Path, target: Path) -> None:
    """Put folder `new` at `target`; an existing target is swapped out and removed. At every instant
    one of them is at `target` (or, without renameat2, at `.NAME.old<PID>`, restored by clean_stale)."""
    if not target.exists():
        os.replace(new, target)
        return
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)     # `new` now holds the old folder
        return
    old = temp_path(target, "old")
    os.replace(target, old)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_folder(output: str | Path, marker: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a fresh `.NAME.tmp<PID>` folder beside `output`; on success it gets the marker and the
    umask's permissions and replaces `output`; on any exception (Ctrl-C, SIGTERM) it is removed.
    Leftovers of dead processes beside `output` are cleaned first. Check the target with
    `check_output_folder` before the expensive work."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(output.parent)
    tmp = temp_path(output)
    if tmp.exists():
        _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        write_marker(tmp, marker or {})
        apply_umask(tmp)
        replace_folder(tmp, output)
    except BaseException:
        _remove(tmp)
        raise
