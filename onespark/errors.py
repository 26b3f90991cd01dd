from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator


def read_secret(path: str, flag: str) -> str:
    """The first line of a key file (--api-key-file): keys on a command line show in `ps`."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.readline(64 * 1024)
    except OSError as e:
        raise UserError(f"cannot read {flag} {path}: {e.strerror}") from e
    # Whoever can write the file chooses the key the server accepts: refused, as ssh refuses a private key
    # others can touch (a pipe, `--api-key-file <(pass show k)`, is no file anyone else opens).
    if stat.S_ISREG(mode) and mode & 0o022:
        who = "group and others" if mode & 0o022 == 0o022 else "others" if mode & 0o002 else "its group"
        raise UserError(f"{flag} {path}: writable by {who} (mode {stat.S_IMODE(mode):04o}), who could change the key: "
                        f"chmod go-w {path} (or chmod 600 {path}), then run the same command again")
    # An HTTP header carries ASCII only: a BOM, a UTF-16 file or a binary file would fail deep inside the client
    # (serve's and bench's), with the key's bytes in the traceback. The value itself is never shown.
    key = raw.removeprefix(b"\xef\xbb\xbf").strip()
    if not key.isascii() or not all(32 < c < 127 for c in key):
        raise UserError(f"{flag} {path}: the key's first line is not plain printable ASCII (a UTF-16 or binary "
                        f"file, or a character a copy-paste added?): write the key alone on the first line")
    if not key:
        raise UserError(f"{flag} {path} is empty: put the key on its first line")
    return key.decode("ascii")


def check_key_pair(value: str | None, file: str | None, flag: str) -> None:
    """FLAG with FLAG-file (--api-key and --api-key-file): refused, in every command that takes both, since which
    one wins would be a guess."""
    if value and file:
        raise UserError(f"give {flag} or {flag}-file, not both")


def plain_key(key: str | None, where: str) -> str | None:
    """A key given as a value (--api-key, $ONESPARK_API_KEY), held to read_secret's rule: an HTTP header carries
    printable ASCII only, and a key with an accent or a line break would fail in the smoke request, after the
    server started. None and "" (no key) pass as None. The value itself is never shown."""
    if not key:
        return None
    if not key.isascii() or not all(32 < ord(c) < 127 for c in key):
        raise UserError(f"{where}: the key is not plain printable ASCII (a space, a line break or a character a "
                        "copy-paste added?): set it again, or put it alone on the first line of --api-key-file")
    return key


class UserError(Exception):
    """A problem the user can fix. The CLI prints it as one line on stderr and exits 1.

    The message says what is wrong and what to do, e.g.
    "shard model-00003-of-00014.safetensors is truncated (4.1 GB of 5.0 GB): re-run `onespark download`".
    """


# errno -> (what happened, what to do). Every command's OSError reaches the CLI's one handler
# (onespark/cli.py), which prints this as one line naming the path; `{dir}` is the path's directory.
_OS_FIXES = {
    errno.EACCES: ("permission denied", "give this user access to it (ls -ld; chmod/chown) or choose another path"),
    errno.EPERM: ("operation not permitted", "give this user access to it (ls -ld; chmod/chown) or choose another path"),
    errno.EROFS: ("read-only file system", "choose a directory on a writable file system"),
    errno.ENOSPC: ("no space left on the device (disk full, or out of inodes)",
                   "check `df -h {dir}` and `df -i {dir}`, free space or choose another directory, then run the "
                   "same command again (finished files are kept)"),
    errno.EDQUOT: ("disk quota exceeded", "free space under your quota or choose another directory, then run the "
                                          "same command again"),
    errno.ENOTDIR: ("is, or lies under, a file where a directory is expected",
                    "remove or rename that file, or choose another path"),
    errno.EEXIST: ("exists and is not a directory", "remove or rename it, or choose another path"),
    errno.EISDIR: ("is a directory where a file is expected", "give the path of a file"),
    errno.ENOENT: ("does not exist", "check the path"),
    errno.EIO: ("input/output error", "the disk or file system is failing: check `dmesg`, copy the data elsewhere"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n 65536) and run the same command again"),
    errno.ENAMETOOLONG: ("file name too long", "choose a shorter path"),
}


def os_error_message(e: OSError) -> str:
    """One line for an operating-system error: the path, what happened, the fix."""
    path = e.filename if e.filename is not None else "(unknown path)"
    what, fix = _OS_FIXES.get(e.errno, (e.strerror or str(e), "check the path and run the same command again"))
    if e.filename2 is not None:
        path = f"{path} -> {e.filename2}"
    directory = os.path.dirname(os.path.abspath(str(e.filename))) if e.filename is not None else "."
    return f"{path}: {what}: {fix.format(dir=directory)}"


@contextlib.contextmanager
def at_path(path, *also) -> Iterator[None]:
    """Attribute an OSError that names no file (os.write, os.fsync, copy_file_range on descriptors), or names
    one of `also` (a temp name), to `path`, so the user reads the file they asked for."""
    try:
        yield
    except OSError as e:
        if e.filename is None or str(e.filename) in {str(a) for a in also}:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
