"""Polite stops of `tightrope run` handled like Ctrl-C: the Train node saves the LoRA and training state of the last
completed step, and the process exits with a message and 128 + the signal's number.

    SIGTERM   docker stop, systemd, Kubernetes, SLURM at the time limit or on preemption        exit 143
    SIGHUP    the terminal or SSH session closed                                                 exit 129
    SIGUSR1   SLURM's `--signal=USR1@<seconds>` warning before the time limit (its default
              action would kill the process with nothing saved)                                  exit 138
    SIGBREAK  Windows: Ctrl-Break (closing the console window ends the process as soon as the C
              runtime's handler returns, before Python's runs: nothing past the last save)     exit 149
    SIGINT    Ctrl-C: a KeyboardInterrupt, as Python's own handler raises                        exit 130

The handler raises StopSignal (a KeyboardInterrupt) in the main thread, exactly where Ctrl-C would: everything that
saves on Ctrl-C saves on these. While the trainer applies an optimizer step the stop is held back until the step is
wholly done (training/held_stops.py), so the saved LoRA is exactly the step it is labelled with. A second polite
signal while that save runs is ignored (with a note), so the save is not cut short; SIGKILL, which always follows
after the grace period, cannot be caught. Handlers are installed only by the CLI, for the duration of a run, only
from the main thread (Python allows no other), and the previous ones are restored after; ComfyUI, which has its own,
never gets them.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

from ..training.held_stops import forget_raised, hold

_POLITE_NAMES = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGBREAK")  # each where the OS has it (SIGBREAK: Windows only)
EXIT_CTRL_C = 128 + signal.SIGINT


class StopSignal(KeyboardInterrupt):
    """A polite stop signal, raised like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def polite_stops() -> Iterator[None]:
    """Within this block, SIGTERM/SIGHUP/SIGUSR1/SIGBREAK raise StopSignal and SIGINT KeyboardInterrupt in the main
    thread, held back while an optimizer step is applied; outside the main thread, a no-op (signal handlers can only be
    set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = []

    def handler(signum, _frame):
        if stopping:  # the first stop is saving the last completed step: let it finish
            print(f"\n{signal.Signals(signum).name} again: still saving the last completed step, then exiting",
                  file=sys.stderr, flush=True)
            return
        stopping.append(signum)
        stop = KeyboardInterrupt() if signum == signal.SIGINT else StopSignal(signum)
        if not hold(stop):
            raise stop

    forget_raised()
    polite = (getattr(signal, name) for name in _POLITE_NAMES if hasattr(signal, name))
    previous = {s: signal.signal(s, handler) for s in (*polite, signal.SIGINT)}
    try:
        yield
    finally:
        forget_raised()
        for s, old in previous.items():
            signal.signal(s, old)


def report_stop(stop: KeyboardInterrupt, *, saved: bool = True, quiet: bool = False) -> int:
    """Print what a stop (Ctrl-C or a polite signal) kept and how to go on; returns the exit code, 128 + signal.
    saved: a Train node of the workflow has a state --resume goes on from (else no step had completed: nothing to
    resume); quiet: say nothing (the other ranks under torchrun: rank 0 reports)."""
    how = str(stop) if isinstance(stop, StopSignal) else "interrupted (Ctrl-C)"
    kept = ("Train nodes saved their last completed step: run again with --resume to continue from it" if saved
            else "no training step had completed, so nothing was saved to resume from")
    if not quiet:
        print(f"\n{how}; {kept}", file=sys.stderr)
    return 128 + stop.signum if isinstance(stop, StopSignal) else EXIT_CTRL_C
