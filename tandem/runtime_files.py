"""The folders tandem's processes create at run time (the device process's shared memory in /dev/shm, the
server's IPC sockets in the temp folder), named so that a survivor or the next start can remove them.

Name: tandem-KIND-PID-RANDOM, PID being the process that created (and owns) the folder. A process killed
with SIGKILL cannot clean up: the survivor that saw it die removes what it owned (remove_owned_by), and
every start removes folders whose owner is no longer alive (sweep_stale).
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile

_NAME = re.compile(r"^tandem-(?:dev|ipc)-(\d+)-[A-Za-z0-9_]+$")


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _bases() -> list[str]:
    return sorted({shm_dir(), tempfile.gettempdir()})


def make_dir(kind: str, base: str) -> str:
    """A new private folder owned by this process (after sweeping stale ones)."""
    sweep_stale()
    return tempfile.mkdtemp(prefix=f"tandem-{kind}-{os.getpid()}-", dir=base)


def map_file(path: str, nbytes: int, create: bool) -> mmap.mmap:
    """A shared mapping of a file for processes to exchange data through: created (exclusive, owner-only,
    nbytes long) or opened; the descriptor is closed at once (the mapping keeps the file)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:                                   # a zombie (dead, not yet reaped) owns nothing any more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def _owned(pred) -> list[str]:
    out = []
    for base in _bases():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            m = _NAME.match(name)
            if m and pred(int(m.group(1))):
                out.append(os.path.join(base, name))
    return out


def remove_owned_by(pid: int) -> None:
    """Remove the folders of a process that is gone (its survivor calls this)."""
    if pid == os.getpid() or alive(pid):
        return
    for path in _owned(lambda p: p == pid):
        shutil.rmtree(path, ignore_errors=True)


def sweep_stale() -> None:
    """Remove every tandem folder whose owner process is dead (left by a SIGKILL)."""
    for path in _owned(lambda p: p != os.getpid() and not alive(p)):
        shutil.rmtree(path, ignore_errors=True)
