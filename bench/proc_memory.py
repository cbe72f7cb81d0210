"""This process's memory as Linux reports it (/proc/self/status), for the host-memory benchmarks."""
from __future__ import annotations

from ..memory.host_memory import malloc_in_use_bytes


def status_bytes(key: str) -> int:
    """A /proc/self/status field given in kB (VmRSS, VmHWM, RssAnon, RssFile, ...), in bytes."""
    with open("/proc/self/status", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def process_memory() -> dict[str, int | None]:
    """RSS, split into anonymous and file-backed pages (code of the libraries touched, mapped files), and what malloc
    has handed out (None without glibc)."""
    return {"rss": status_bytes("VmRSS"), "anon": status_bytes("RssAnon"), "file": status_bytes("RssFile"),
            "malloc_in_use": malloc_in_use_bytes()}
