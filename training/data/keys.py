"""Content keys: the dataset's cache file names and its per-epoch random streams come from the same hash."""
from __future__ import annotations

import hashlib
import re

SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # what content_key returns (and a file's sha256 hexdigest)


def content_key(*parts: str | bytes) -> str:
    """sha256 hex of the parts, each followed by a separator, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8") if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def epoch_stream_seed(*parts) -> int:
    """A 63-bit seed from (seed, purpose, epoch): independent streams that a resumed run can rebuild."""
    return int(content_key(*(str(p) for p in parts))[:16], 16) >> 1
