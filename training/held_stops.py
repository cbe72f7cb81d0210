"""Stops held back while the trainer applies one optimizer step, so a saved LoRA is exactly the step it is labelled.

A stop (Ctrl-C or a polite signal, headless/stop_signals.py) raises in the main thread wherever Python happens to be.
Between `optimizer.step()` and the step count going up, that would save updated weights labelled with the previous
step, and `--resume` would apply that update twice. The signal handler asks `hold(stop)` first: inside
`held_stops()` the stop is kept and raised when the block ends, so the step is either wholly done or not begun.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_depth = 0
_held: list[BaseException] = []
_raised: list[BaseException] = []  # a stop a signal handler raised: it may have been swallowed (raise_swallowed)


@contextlib.contextmanager
def held_stops() -> Iterator[None]:
    """Within this block a stop passed to `hold` waits; it is raised when the block completes (an error raised in the
    block wins: the process is ending anyway, and the error says more)."""
    global _depth
    _depth += 1
    try:
        yield
    except BaseException:
        if _depth == 1:
            _held.clear()
        raise
    finally:
        _depth -= 1
    if not _depth and _held:
        stop = _held[0]
        _held.clear()
        raise stop


def hold(stop: BaseException) -> bool:
    """For a signal handler: True if `stop` is held back (it will be raised later), False if it should raise now."""
    if _depth:
        _held.append(stop)
        return True
    _raised[:] = [stop]
    return False


def raise_swallowed() -> None:
    """Raise again a stop the signal handler raised where Python ignores exceptions: a signal is handled at the next
    Python code that runs, which can be a weakref finalizer or __del__ run by a C call freeing an object (the memory
    runtime registers finalizers on every weight view); an exception there is printed as "Exception ignored" and
    dropped. Call where a stop is safe (between steps, between nodes): a stop that did arrive has left the loop."""
    if _raised:
        raise _raised.pop()


def forget_raised() -> None:
    """The stop handlers are gone (stop_signals.polite_stops exits): nothing is pending."""
    _raised.clear()
