"""One training run per output folder: `RunLock(out)` holds `out/.run.lock` (an flock, so a run killed by any
signal frees it and the next run takes it over) and writes its owner there (pid, host, thread, start, name),
which a refused run's message names."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK_NAME = ".run.lock"


class RunLock:
    """The lock on a run folder, held from construction until `release()` (or until the process ends)."""

    def __init__(self, out: Path, name: str) -> None:
        self.path = out / LOCK_NAME
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ValueError(f"out: cannot write the run folder {out} ({exc.strerror or exc})") from exc
        self.file = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = self.file.read().strip() or "an owner that has not written its name yet"
            self.file.close()
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"out: cannot lock the run folder {out} ({exc.strerror})") from exc
            raise ValueError(
                f"out: the run folder {out} is in use by another run ({describe(owner)}); wait for it, "
                "stop it, or pass another --out"
            ) from exc
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "thread": threading.current_thread().name,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "name": name,
        }
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(record))
        self.file.flush()

    def release(self) -> None:
        """Free the folder for the next run (the lock file stays, naming no one who holds it)."""
        if not self.file.closed:
            self.file.seek(0)
            self.file.truncate()
            self.file.close()


def describe(owner: str) -> str:
    """The lock file's owner record as a phrase: 'run NAME, pid P on HOST (thread T), started S'."""
    try:
        o = json.loads(owner)
        return f"run {o['name']!r}, pid {o['pid']} on {o['host']} (thread {o['thread']!r}), started {o['started']}"
    except (ValueError, KeyError, TypeError):
        return owner[:200]
