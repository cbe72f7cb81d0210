"""A rank that waited for another in a collective and found it gone (its process ended: an error, a signal, a
kill): one line naming this rank and the collective, instead of gloo's traceback, which read like a bug of the
surviving rank and pushed the failing rank's own message out of sight."""
from __future__ import annotations

import contextlib
import re
from typing import Iterator


class RankLostError(RuntimeError):
    """Another rank ended (failed, was stopped or killed) while this one waited for it in a collective: not this
    rank's fault and not a bug, so `tightrope run` prints it as one line (exit 1); the original is __cause__."""


# what gloo (and NCCL's socket transport) report when the other end of a collective has gone away
_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?|Broken pipe|"
                        r"remote process exited or there was a network error")


@contextlib.contextmanager
def collective(what: str, rank: int) -> Iterator[None]:
    """Around one collective of rank `rank`: a peer gone becomes a RankLostError; any other error stays as it was."""
    try:
        yield
    except RuntimeError as exc:
        gone = _PEER_GONE.search(str(exc))
        if gone is None or isinstance(exc, RankLostError):
            raise
        raise RankLostError(f"rank {rank} lost another rank during {what} ({gone.group(0).strip()}): a rank ended "
                            f"first and its own output above says why; rank {rank} stops too") from exc
