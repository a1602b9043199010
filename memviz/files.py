"""Atomic writes: every file goes to a temporary name in its folder and is renamed into place, so an
interrupted save never leaves a half-written file under the real name; a folder of files that belong
together (a checkpoint) is written beside its place and swapped in whole (`replace_folder`)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the system cannot."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system or kernel cannot
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def replace_folder(directory: str | Path, write: Callable[[Path], object]) -> Path:
    """Write a folder beside `directory` (`write(staging)`), then put it in `directory`'s place whole, so a save
    killed at any point leaves the earlier folder as it was: never new weights beside an old config. Files in the
    earlier folder that this write does not make are kept (linked into the new one). Leftovers of killed writes
    (`.NAME.writing-PID` beside it) are removed by the next write."""
    import shutil

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a folder: nothing written over it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    for leftover in directory.parent.glob(f".{directory.name}.writing-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    staging = directory.parent / f".{directory.name}.writing-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        if directory.is_dir():
            for old in directory.iterdir():  # what this write does not make stays
                if not (staging / old.name).exists():
                    if old.is_dir():
                        shutil.copytree(old, staging / old.name, copy_function=os.link)
                    else:
                        os.link(old, staging / old.name)
            if not exchange(staging, directory):
                aside = directory.parent / f".{directory.name}.writing-{os.getpid()}-old"
                directory.rename(aside)  # where no exchange exists: a short window with no folder at all
                staging.rename(directory)
                staging = aside
        else:
            staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
