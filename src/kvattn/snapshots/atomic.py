"""Atomic writes of snapshot files: a crash or kill at any point leaves the old file or the new one.

A save writes the whole file to an unnamed file in the target's directory
(Linux `O_TMPFILE`: a kill leaves nothing behind), fsyncs it, names it
`.{name}.{pid}.{random}.tmp` and renames that onto the target, so a crash
or kill at any point leaves the old file or the new one. Where `O_TMPFILE`
is missing the bytes go to that named file directly. A kill can then leave
the named file, which the next save to the same path removes once no
process on that machine has that pid (so two machines must not save to
one path at once on a shared file system; no two savers of one path
should, as only one file can win).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, payload: bytes) -> None:
    """Writes `payload` to `path` so that a crash or kill at any point leaves the old file or the new one.

    Removes first the temp files of `path` that dead processes left. The new
    file, like `tempfile.mkstemp`'s, is readable and writable by its owner only.
    """
    remove_stale_temp_files(path)
    temp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = open_unnamed(path.parent)
        unnamed = fd is not None
        if not unnamed:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        with os.fdopen(fd, "wb") as file:
            write_and_sync(file, payload)
            if unnamed:
                name_unnamed(file.fileno(), temp)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    sync_directory(path.parent)


def open_unnamed(directory: Path) -> int | None:
    """A writable file in `directory` without a name (`O_TMPFILE`), or None where the system has none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(directory, flag | os.O_WRONLY, 0o600)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):  # a file system or kernel without it
            return None
        raise


def name_unnamed(fd: int, name: Path) -> None:
    """Links the unnamed file `fd` as `name`: linkat with AT_SYMLINK_FOLLOW, which Python uses given a directory fd."""
    directory = os.open(name.parent, os.O_RDONLY)
    try:
        os.link(f"/proc/self/fd/{fd}", name.name, dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


def write_and_sync(file, payload: bytes) -> None:
    file.write(payload)
    file.flush()
    os.fsync(file.fileno())


def remove_stale_temp_files(path: Path) -> None:
    """Removes `path`'s temp files (`.{name}.{pid}.{random}.tmp`) whose writing process no longer exists."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    for name in os.listdir(path.parent):
        match = pattern.fullmatch(name)
        if match and not process_exists(int(match[1])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.parent / name)


def process_exists(pid: int) -> bool:
    if os.name != "posix":
        return True  # elsewhere os.kill would end the process, not probe it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or not a pid: not ours to judge
        return True
    return True


def sync_directory(directory: Path) -> None:
    """Makes the rename itself durable (POSIX; elsewhere a directory cannot be opened)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
