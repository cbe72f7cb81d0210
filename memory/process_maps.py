"""This process's memory mappings as Linux lists them (/proc/self/maps): which host memory is a file, private,
writable. The one parser behind host_pinning (how a range may be page-locked), host_memory (what is page cache) and
shared_host (which mappings are the ranks' shared weights)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str   # e.g. "rw-p": read, write, execute, private (p) or shared (s)
    path: str    # the file mapped ("/..."), a pseudo-name ("[heap]"), or "" for anonymous memory

    @property
    def writable(self) -> bool:
        return self.perms[1] == "w"

    @property
    def private_file(self) -> bool:
        return self.perms[3] == "p" and self.path.startswith("/")

    def overlaps(self, start: int, nbytes: int) -> bool:
        return self.start < start + nbytes and start < self.end


def mappings() -> list[Mapping] | None:
    """Every mapping of this process, in address order; None where the system does not list them (not Linux)."""
    try:
        # paths are bytes as the file system holds them: decoded as os.fsdecode does, so a mapped file whose name
        # is not UTF-8 (a folder named in Latin-1) is not a UnicodeDecodeError in the middle of a run
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.readlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(None, 5)  # range, perms, offset, dev, inode, path
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.append(Mapping(start, end, fields[1], fields[5].strip() if len(fields) == 6 else ""))
    return out
