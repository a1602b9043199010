"""Atomic writes: every file goes to a temporary name in its folder and is renamed into place, so an
interrupted save never leaves a half-written file under the real name; a folder of files that belong
together (a checkpoint) is written beside its place and swapped in whole (`replace_folder`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the problem."""


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    if path.is_dir():  # before any temporary file: os.replace would fail on it only after the write
        raise IsADirectoryError(f"{path} is a folder; give the path of a file to write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # named by the file asked for, not the temporary one beside it
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc
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
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EBUSY):  # this file system cannot
        return False
    raise OSError(code, os.strerror(code), str(b))


def keep_beside(old: Path, new: Path) -> None:
    """Put what `old` holds into `new` (a link, a hard link, or a copy across file systems)."""
    import shutil

    if old.is_symlink():
        os.symlink(os.readlink(old), new)
    elif old.is_dir():
        shutil.copytree(old, new, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(old, new)


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def replace_folder(directory: str | Path, write: Callable[[Path], object]) -> Path:
    """Write a folder beside `directory` (`write(staging)`), then put it in `directory`'s place whole, so a save
    killed at any point leaves the earlier folder as it was: never new weights beside an old config. Files in the
    earlier folder that this write does not make are kept. A symbolic link is followed (its target is replaced).
    Leftovers of killed writes (`.NAME.writing-PID-*` beside it, their process gone) are removed by the next write."""
    import shutil
    import tempfile

    directory = Path(os.path.realpath(directory))
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a folder: nothing written over it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    sweep_killed_writes(directory.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.writing-{os.getpid()}-", dir=directory.parent))
    try:
        write(staging)
        if not directory.is_dir():
            staging.rename(directory)
            return directory
        for old in directory.iterdir():  # what this write does not make stays
            if not (staging / old.name).exists() and not (staging / old.name).is_symlink():
                keep_beside(old, staging / old.name)
        if not exchange(staging, directory):
            aside = Path(tempfile.mkdtemp(prefix=f".{directory.name}.writing-{os.getpid()}-", dir=directory.parent))
            aside.rmdir()
            directory.rename(aside)  # where no exchange exists: a short window with no folder at all
            staging.rename(directory)
            staging = aside
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def sweep_killed_writes(folder: Path) -> None:
    """Remove the staging folders (`.NAME.writing-PID-*`) that `replace_folder` writes in `folder` whose process is
    gone: what a save killed part-way leaves."""
    import re
    import shutil

    for leftover in folder.iterdir() if folder.is_dir() else ():
        match = re.fullmatch(r"\..+\.writing-(\d+)-.*", leftover.name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(leftover, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process of that id runs here (a leftover's owner may still be writing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: a checkpoint's config.json (native or Hugging Face) is a few KB; past this it is not a config
MAX_CONFIG_BYTES = 4 * 2**20


def check_regular_file(path: str | Path, limit: int, what: str) -> int:
    """The size of `path`, a regular file of at most `limit` bytes, checked before anything is read; otherwise one
    ValueError naming the file, what it is for and the limit (a folder, a device such as /dev/zero, a pipe)."""
    import stat

    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"{what} must be a path, got {path!r}")
    try:
        info = os.stat(path)
    except FileNotFoundError as exc:
        raise ValueError(f"{what} {path} does not exist") from exc
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(
            f"{what} {path} is not a regular file (a device or a pipe has no size to check); nothing was read"
        )
    if info.st_size > limit:
        raise ValueError(
            f"{what} {path} has {info.st_size:,} bytes, over the {limit:,} a {what} may have; nothing was read"
        )
    return info.st_size


def read_bytes_within(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (`check_regular_file`), never more than that read."""
    check_regular_file(path, limit, what)
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{what} {path} cannot be read: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise ValueError(f"{what} {path} grew past the {limit:,} bytes a {what} may have while it was read")
    return data


def check_writable_folder(path: str | Path, what: str) -> None:
    """Refuse, before any work, a folder that cannot be written: a path that is a file, a folder without write
    permission, or a place where it cannot be made (ValueError naming `what` and the path)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} exists and is not a folder")
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{what} {path} cannot be made: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} cannot be written: no write permission in {ancestor}")
