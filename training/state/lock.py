"""An exclusive OS lock on a training state file while a Train node trains into it.

Two runs writing one state file (two `tightrope run` processes with one output dir, two ComfyUI servers sharing a
user folder) would replace each other's state and resume from a mix; the second one is refused instead. The lock is
`<state file>.lock`, held with flock (POSIX) or msvcrt.locking (Windows); the OS releases it when the process
dies, so a killed run never leaves a stale lock. Under torchrun only rank 0 writes state, so only rank 0 locks.
"""
from __future__ import annotations

import contextlib
import errno
import os
import warnings
from pathlib import Path
from typing import IO, Iterator

from .. import distributed
from .atomic_write import LONG_PATHS_FIX, FileWriteError, long_path_problem

LOCK_SUFFIX = ".lock"
# errnos meaning "another process holds it" (msvcrt reports EACCES or EDEADLK)
_HELD = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES, errno.EDEADLK}


class StateLockedError(RuntimeError):
    """Another run holds the lock of this training state file; the message names it and the fix."""


@contextlib.contextmanager
def state_lock(state_file: Path) -> Iterator[None]:
    """Hold the lock of `state_file` for the block; raises StateLockedError at once if another run holds it."""
    held: list[IO[bytes]] = []
    distributed.on_main_rank(lambda: held.extend(_acquire(Path(state_file))))  # a refusal stops every rank
    try:
        yield
    finally:
        for handle in held:
            _release(handle)


def _acquire(state_file: Path) -> list[IO[bytes]]:
    lock = state_file.with_name(state_file.name + LOCK_SUFFIX)
    too_long = long_path_problem(state_file.with_name(f".{state_file.name}.{'0' * 8}.tmp"))  # its longest file
    if too_long:
        raise FileWriteError(state_file, errno.ENAMETOOLONG, f"its path, with its temp file's name, is {too_long}",
                             fix=LONG_PATHS_FIX)
    lock.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock, "a+b")
    try:
        _lock(handle)
    except OSError as e:
        handle.close()
        if e.errno in _HELD:
            raise StateLockedError(
                f"another run is training into the training state file '{state_file}' (it holds '{lock}'): wait for "
                "it to finish, or give this run another output folder (`tightrope run --output-dir`) or another "
                "filename_prefix") from None
        warnings.warn(f"could not lock '{lock}' ({e.strerror}; this file system has no file locks): another run "
                      "writing the same output folder and filename_prefix would overwrite this run's training state",
                      stacklevel=3)
        return []
    return [handle]


if os.name == "nt":
    import msvcrt

    def _lock(handle: IO[bytes]) -> None:
        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)  # one byte stands for the file

    def _release(handle: IO[bytes]) -> None:
        try:
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)
        finally:
            handle.close()
else:
    import fcntl

    def _lock(handle: IO[bytes]) -> None:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _release(handle: IO[bytes]) -> None:
        handle.close()  # closing the only descriptor of this open file releases its flock
