"""Counting the files a piece of code opens: every open Python makes (builtins/io.open, os.open, Pillow's, pathlib's)
raises the "open" audit event, which a hook installed once per process records while a count is running."""
from __future__ import annotations

import contextlib
import os
import sys

_counting: list[list[str]] = []


def _hook(event: str, args: tuple) -> None:
    if event == "open" and _counting and isinstance(args[0], (str, bytes, os.PathLike)):
        _counting[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_hook)  # audit hooks cannot be removed: it does nothing outside count_opens


@contextlib.contextmanager
def count_opens():
    """with count_opens() as opened: ... -> the paths opened inside, in order."""
    opened: list[str] = []
    _counting.append(opened)
    try:
        yield opened
    finally:
        _counting.pop()
