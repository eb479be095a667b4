"""One process writes a run directory at a time.

    with WorkdirLock(workdir):   # raises WorkdirBusy naming the process that holds it
        ...

An advisory lock (fcntl.flock) on <workdir>/.lock: the kernel drops it when its holder dies, even
by SIGKILL, so a crashed run never leaves a stale lock behind. The file records who holds it
(pid, host, start time, command), which the error message quotes.
"""
from __future__ import annotations

import fcntl
import os
import socket
import sys
import time

LOCK_NAME = ".lock"


class WorkdirBusy(RuntimeError):
    """Another process holds the run directory."""


class WorkdirLock:
    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirBusy(
                f"{os.path.dirname(self.path)} is in use by another run ({holder}); stop it "
                "first, or use another --workdir") from None
        os.ftruncate(fd, 0)
        info = (f"pid {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)[:300]}")
        os.pwrite(fd, info.encode(), 0)
        self._fd = fd
        return self

    def release(self):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False
