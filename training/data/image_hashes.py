"""Each image file's sha256 remembered between loads, so a second load of an unchanged folder reads no image whole.

The latent cache key starts with the sha256 of the image file's bytes (dataset.py), and hashing every file on every
load reads the whole dataset again (a 20 GB folder on a slow disk: minutes per headless run or resume). So the cache
folder keeps an index, image_hashes.safetensors (its metadata is JSON; no tensors, no pickle), of each image's sha256
under its absolute path, with what git's index trusts a file unchanged by: its size, modification and change times
(ns), inode and device. A load trusts an entry only when all of these are as recorded, and the file was last modified
well before it was hashed (git's "racily clean" rule: a file written again within the file system's timestamp
granularity of its hashing could keep every stat field, so such an entry is hashed again at the next load, which then
records one that is safe). Anything in doubt is read and hashed: an unreadable or foreign index, a field missing or
different, a file that changed while it was hashed (then not recorded). An edit in place that keeps the size and sets
the modification time back still changes the change time (and a replacing save the inode), so it is hashed again.
On Windows st_ctime is the creation time, which an edit in place keeps: there an edit that also sets the modification
time back is not seen (as git does not see it); any ordinary save changes the modification time.

The index is written atomically (atomic_write.py) after a load that hashed something, merged with the entries of
other folders (datasets share a cache folder); entries under the loaded folder that this load did not see (images
deleted or renamed) are dropped. Two processes loading at once (torchrun ranks) each write it whole: the last writer
wins, and an entry either lost is only hashed again. A read-only cache folder gets no index and loads as before."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from safetensors import safe_open

from ..state.atomic_write import atomic_save_file
from .image_folder import DatasetError
from .keys import SHA256_HEX

INDEX_NAME = "image_hashes.safetensors"
_FORMAT = "tightrope.image_hashes.1"
# A file modified less than this before it was hashed is hashed again at the next load: more than any file system's
# timestamp granularity (FAT: 2 s) and the lag of the kernel's coarse clock behind time.time_ns().
RACY_NS = 3_000_000_000


def file_key(path: Path) -> list[int]:
    """What says a file is unchanged: [size, mtime_ns, ctime_ns, inode, device] (os.stat follows links)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class ImageHashes:
    """The index of one load: digest() per image, then save(root) once. cache_dir None: every image is hashed."""

    def __init__(self, cache_dir: Path | None):
        self.path = None if cache_dir is None else Path(cache_dir) / INDEX_NAME
        self.trusted = self.hashed = 0  # digests taken from the index / read and hashed, this load
        self._seen, self._changed, self._skew = {}, False, 0
        self._known = self._read()

    def _read(self) -> dict:
        """The stored entries; {} for a missing, damaged or foreign index (everything is hashed again)."""
        if self.path is None:
            return {}
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
            known = json.loads(meta["entries"]) if meta.get("format") == _FORMAT else {}
            # the cache's file system clock against the writer's time.time_ns(): behind it (an NFS server's, say),
            # a file written after its hashing could look older than that, so the racy rule moves by as much
            self._skew = min(0, os.stat(self.path).st_mtime_ns - int(meta["written_ns"]))
        except Exception:  # missing, unreadable, damaged, or a field missing: hash everything
            return {}
        return known if isinstance(known, dict) else {}

    def _trusted(self, entry, key: list[int] | None) -> bool:
        return (key is not None and isinstance(entry, list) and len(entry) == 7 and entry[:5] == key
                and isinstance(entry[5], int) and key[1] + RACY_NS < entry[5] + self._skew
                and isinstance(entry[6], str) and SHA256_HEX.fullmatch(entry[6]) is not None)

    def digest(self, path: Path, *, trust: bool = True) -> tuple[str, bytes | None]:
        """(the file's sha256 hex, its bytes; None where the index vouched for the digest and nothing was read).
        trust=False reads and hashes it in any case."""
        name = os.path.abspath(path)
        try:
            key = file_key(path)
        except OSError:
            key = None  # read_bytes below says why
        entry = self._known.get(name)
        if trust and self._trusted(entry, key):
            self._seen[name] = entry
            self.trusted += 1
            return entry[6], None
        started = time.time_ns()
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DatasetError(f"cannot read image '{path}' ({e.strerror or e}): check that it is readable") from None
        digest = hashlib.sha256(data).hexdigest()
        self.hashed += 1
        try:
            unchanged = key is not None and file_key(path) == key
        except OSError:
            unchanged = False
        if unchanged:  # not recorded if it changed while read: the next load hashes it again
            self._seen[name] = key + [started, digest]
            self._changed |= entry != self._seen[name]
        return digest, data

    def save(self, root: Path) -> None:
        """Write the index if this load hashed something new or dropped something: the entries seen, and those of
        other folders. Nothing is written to a read-only cache (or on any failure: the index only saves reading)."""
        if self.path is None:
            return
        inside = os.path.join(os.path.abspath(root), "")
        kept = {k: v for k, v in self._known.items() if k not in self._seen and not k.startswith(inside)}
        if not self._changed and len(kept) + len(self._seen) == len(self._known):
            return
        metadata = {"format": _FORMAT, "written_ns": str(time.time_ns()), "entries": json.dumps(kept | self._seen)}
        try:
            atomic_save_file({}, self.path, metadata)
        except Exception:  # read-only or full cache folder, an index too large for a safetensors header: no index
            pass
