"""One writer per output directory: an fcntl lock on DIR/.onespark.lock for as long as a step writes there.

Two `onespark hybrid` runs into one --out deleted each other's temp files; now the second one says who holds
the directory and exits 1. The kernel drops the lock when its holder exits, kill -9 included, so a stale lock
file never blocks a re-run. The file stays (deleting it would let a third run lock a fresh file while a
second still holds the old one); it holds the holder's pid and command, for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from onespark.errors import UserError

LOCK_FILE = ".onespark.lock"


COMMAND: str | None = None  # set by onespark.cli.main: the command line as the user typed it


def _command() -> str:
    return COMMAND or f"python {shlex.join(sys.argv)[:200]}"


@contextlib.contextmanager
def locked(directory: Path, flag: str) -> Iterator[None]:
    """Hold DIR's lock (creating DIR) or raise UserError naming the holder; `flag` names DIR for the user.
    A DIR this call created and nothing else wrote into is removed again on the way out (a refused input
    leaves no empty --out behind)."""
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{flag} {directory} is in use by {holder}: wait for it to finish (or stop it), "
                            f"then run this again") from None
        # Locked the file that still has this name? (A run that created DIR may have just removed it.)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({_command()})\n".encode(), 0)
        yield
    finally:
        if created and [p.name for p in directory.iterdir()] == [LOCK_FILE]:
            path.unlink()
            directory.rmdir()
        os.close(fd)  # closing drops the lock
