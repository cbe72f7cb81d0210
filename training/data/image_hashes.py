"""Each image file's sha256 and header remembered between loads, so a second load of an unchanged folder opens no
image (or mask) file.

The latent cache key starts with the sha256 of the image file's bytes (dataset.py), and hashing every file on every
load reads the whole dataset again (a 20 GB folder on a slow disk: minutes per headless run or resume); bucketing and
the folder's checks need each image's header (size after EXIF rotation, frames, alpha: image_folder.read_header),
whose reading walks every PNG's chunks (scattered reads of about a tenth of its bytes). So the cache folder keeps an
index, image_hashes.safetensors (its metadata is JSON; no tensors, no pickle), of each file's sha256 and header under
its absolute path (mask files too), with what git's index trusts a file unchanged by: its size, modification and
change times (ns), inode and device. A load trusts an entry only when all of these are as recorded, and the file was
last modified well before it was hashed (git's "racily clean" rule: a file written again within the file system's
timestamp granularity of its hashing could keep every stat field, so such an entry is hashed again at the next load,
which then records one that is safe). Anything in doubt is read and hashed: an unreadable or foreign index, a field
missing or different, a file that changed while it was hashed (then not recorded). An edit in place that keeps the
size and sets the modification time back still changes the change time (and a replacing save the inode), so it is
hashed again. On Windows st_ctime is the creation time, which an edit in place keeps: there an edit that also sets
the modification time back is not seen (as git does not see it); any ordinary save changes the modification time.
A header is recorded from the very bytes hashed (or, for an entry the index vouches for that has none yet: an index
of the first format, another Pillow, read from the file with its stat unchanged across the read); a remembered size
is checked against max_image_pixels as a read one is.

The index is written atomically (atomic_write.py) after a load that recorded something new, merged with the entries
of other folders (datasets share a cache folder: one per ComfyUI, one per --output-dir) as the file holds them then:
another process that wrote it during this load keeps its entries (only one writing in the instant between that read
and the rename loses its own, which are then hashed again). What leaves it, so that it does not grow forever: entries
under the loaded folder whose files are gone; other folders' entries whose folder is gone (one stat per folder, only
when the index is written anyway), a week after their hashing (GONE_AFTER_NS); and past MAX_ENTRIES the other
folders' entries hashed longest ago. Entries of folders that still exist but are not loaded stay: they are valid, and
a load of one of them again would otherwise read it whole. A read-only cache folder gets no index and loads as
before."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import PIL
from safetensors import safe_open

from ..state.atomic_write import atomic_save_file
from .image_folder import DatasetError, ImageHeader, check_pixels, read_header
from .keys import SHA256_HEX

INDEX_NAME = "image_hashes.safetensors"
_FORMAT = "tightrope.image_hashes.2"
_FORMATS = (_FORMAT, "tightrope.image_hashes.1")  # 1: digests without headers (trusted, their headers read once)
# What read_header's answers depend on besides the file: bump the number when its rules change (EXIF, frames); a
# Pillow upgrade may parse a header otherwise too. Headers recorded under another are read from their files again
# (the digests stay trusted).
HEADER_VERSION = f"1 Pillow {PIL.__version__}"
# A file modified less than this before it was hashed is hashed again at the next load: more than any file system's
# timestamp granularity (FAT: 2 s) and the lag of the kernel's coarse clock behind time.time_ns().
RACY_NS = 3_000_000_000
# At most this many entries (about 250 bytes each): past them the other folders' entries hashed longest ago are left
# out. A safetensors header holds 100 MB, so an index grown past that could no longer be written (each new folder
# then hashed at every load) and a load would parse all of it first.
MAX_ENTRIES = 200_000
# Another folder's entries leave when their folder is gone and they were hashed longer ago than this. Not at once: a
# cache folder shared by machines that mount their datasets at other paths (an --output-dir on NFS, ComfyUI in a
# container and on its host) sees the other's folders as gone, and dropping their entries at each write would have
# each machine read its whole dataset again at every load; so each at most once in this time.
GONE_AFTER_NS = 7 * 86400 * 10**9


def file_key(path: Path) -> list[int]:
    """What says a file is unchanged: [size, mtime_ns, ctime_ns, inode, device] (os.stat follows links)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_key_or_none(path: Path) -> list[int] | None:
    """file_key, or None where the file cannot be stat-ed (gone, unreadable)."""
    try:
        return file_key(path)
    except OSError:
        return None


def _header(entry: list) -> ImageHeader | None:
    """The header a trusted entry remembers (its 8th field: [width, height, frames, alpha]), or None."""
    h = entry[7] if len(entry) == 8 else None
    if isinstance(h, list) and len(h) == 4 and all(type(v) is int for v in h) and h[0] > 0 and h[1] > 0:
        return ImageHeader((h[0], h[1]), bool(h[2]), bool(h[3]))
    return None


class ImageHashes:
    """The index of one load: header() and digest() per file, then save(root) once. cache_dir None: every image is
    read and hashed."""

    def __init__(self, cache_dir: Path | None):
        self.path = None if cache_dir is None else Path(cache_dir) / INDEX_NAME
        self.trusted = self.hashed = 0  # digests taken from the index / read and hashed, this load
        self.headers_read = 0  # headers read from a file this load (the others came from the index or hashed bytes)
        self._seen, self._pending, self._changed, self._skew, self._index_key = {}, {}, False, 0, None
        self._read_now: dict[str, tuple[list[int] | None, ImageHeader]] = {}  # headers read from files this load
        self._known = self._read()

    def _read(self) -> dict:
        """The stored entries; {} for a missing, damaged or foreign index (everything is hashed again)."""
        if self.path is None:
            return {}
        self._index_key = file_key_or_none(self.path)  # save() reads it again only if it changed since
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
            known = json.loads(meta["entries"]) if meta.get("format") in _FORMATS else {}
            # the cache's file system clock against the writer's time.time_ns(): behind it (an NFS server's, say),
            # a file written after its hashing could look older than that, so the racy rule moves by as much
            self._skew = min(0, os.stat(self.path).st_mtime_ns - int(meta["written_ns"]))
        except Exception:  # missing, unreadable, damaged, or a field missing: hash everything
            return {}
        if not isinstance(known, dict):
            return {}
        if meta.get("headers") != HEADER_VERSION:  # headers of another reader: read again
            known = {k: v[:7] if isinstance(v, list) else v for k, v in known.items()}
        return known

    def _trusted(self, entry, key: list[int] | None) -> bool:
        return (key is not None and isinstance(entry, list) and len(entry) in (7, 8) and entry[:5] == key
                and isinstance(entry[5], int) and key[1] + RACY_NS < entry[5] + self._skew
                and isinstance(entry[6], str) and SHA256_HEX.fullmatch(entry[6]) is not None)

    def header(self, path: Path, max_pixels: int, *, data: bytes | None = None) -> ImageHeader:
        """The file's ImageHeader (image_folder.read_header), its pixels checked against max_pixels: from the index
        where it vouches for the file (nothing is opened), else read from `data` (the bytes digest() returned: the
        header is recorded with their digest) or from the file (recorded with the index's digest if the file's stat
        is that entry's before and after the read)."""
        name = os.path.abspath(path)
        if data is not None:
            header = read_header(path, data=data, max_pixels=max_pixels)
            self._attach(name, header, only_seen=True)
            return header
        key = file_key_or_none(path)
        entry = self._known.get(name)
        trusted = self._trusted(entry, key)
        if trusted and _header(entry) is not None:
            check_pixels(path, _header(entry).size, max_pixels)
            return _header(entry)
        if name in self._read_now and self._read_now[name][0] == key and key is not None:  # read once a load
            check_pixels(path, self._read_now[name][1].size, max_pixels)
            return self._read_now[name][1]
        header = read_header(path, max_pixels=max_pixels)
        self.headers_read += 1
        self._read_now[name] = (key, header)
        if trusted and file_key_or_none(path) == key:
            self._attach(name, header, only_seen=False)
        return header

    def _attach(self, name: str, header: ImageHeader, *, only_seen: bool) -> None:
        """Record the header with the file's entry: the one seen this load, else (only_seen False) the index's,
        when digest() takes it."""
        seen = self._seen.get(name)
        if seen is not None and len(seen) == 7:
            self._seen[name] = seen + [[header.size[0], header.size[1], int(header.frames), int(header.alpha)]]
            self._changed |= self._seen[name] != self._known.get(name)
        elif seen is None and not only_seen:
            self._pending[name] = header

    def digest(self, path: Path, *, trust: bool = True) -> tuple[str, bytes | None]:
        """(the file's sha256 hex, its bytes; None where the index vouched for the digest and nothing was read).
        trust=False reads and hashes it in any case."""
        digest, data, _ = self._digest(path, trust, keep=True)
        return digest, data

    def stream_digest(self, path: Path, *, trust: bool = True) -> tuple[str, list[int] | None]:
        """digest() of a file too large to hold (a video clip): read in chunks, nothing kept. (the sha256 hex, the
        file's key (file_key) when it was hashed now: it is those bytes while file_key(path) still equals it; None
        where the index vouched for the digest)."""
        digest, _, key = self._digest(path, trust, keep=False)
        return digest, key

    def _digest(self, path: Path, trust: bool, keep: bool) -> tuple[str, bytes | None, list[int] | None]:
        name = os.path.abspath(path)
        key = file_key_or_none(path)  # None: the read below says why
        entry = self._known.get(name)
        if trust and self._trusted(entry, key):
            self._seen[name] = entry[:7]
            header = _header(entry) or self._pending.pop(name, None)
            if header is not None:
                self._attach(name, header, only_seen=True)
            self.trusted += 1
            return entry[6], None, None
        started = time.time_ns()
        h, data = hashlib.sha256(), None
        try:
            if keep:
                data = path.read_bytes()
                h.update(data)
            else:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
        except OSError as e:
            raise DatasetError(f"cannot read image '{path}' ({e.strerror or e}): check that it is readable") from None
        digest = h.hexdigest()
        self.hashed += 1
        unchanged = key is not None and file_key_or_none(path) == key
        if unchanged:  # not recorded if it changed while read: hashed again
            self._seen[name] = key + [started, digest]
            self._changed = True
        return digest, data, key if unchanged else None

    def save(self, root: Path) -> None:
        """Write the index if this load recorded something new or dropped something: the entries seen, those under
        root whose files still exist (a mask file not used this load, say), and those of other folders as the index
        holds them now (another process may have written it meanwhile), of which those whose folder is gone are
        dropped. Nothing is written to a read-only cache (or on any failure: the index only saves reading)."""
        if self.path is None:
            return
        inside = os.path.join(os.path.abspath(root), "")
        unseen = [k for k in self._known if k not in self._seen]
        gone = {k for k in unseen if k.startswith(inside) and not os.path.exists(k)}
        if not self._changed and not gone:
            return
        fresh = self._known if file_key_or_none(self.path) == self._index_key else self._read() or self._known
        kept = {k: self._known[k] for k in unseen if k.startswith(inside) and k not in gone} | self._seen
        others, folders, old = {}, {}, time.time_ns() - GONE_AFTER_NS
        for k, v in fresh.items():  # one stat per folder, not per file, and only when writing anyway
            if not k.startswith(inside) and k not in kept:
                folder, recent = os.path.dirname(k), not _int_at(v, 5) or v[5] >= old
                if not recent and folder not in folders:
                    folders[folder] = os.path.isdir(folder)
                if recent or folders[folder]:
                    others[k] = v
        if len(others) + len(kept) > MAX_ENTRIES:  # the other folders' entries hashed longest ago leave first
            newest = sorted(others, key=lambda k: others[k][5] if _int_at(others[k], 5) else 0, reverse=True)
            others = {k: others[k] for k in newest[:max(0, MAX_ENTRIES - len(kept))]}
        entries = others | kept
        metadata = {"format": _FORMAT, "headers": HEADER_VERSION, "written_ns": str(time.time_ns()),
                    "entries": json.dumps(entries)}
        try:
            atomic_save_file({}, self.path, metadata)
        except Exception:  # read-only or full cache folder, an index too large for a safetensors header: no index
            pass


def _int_at(entry, i: int) -> bool:
    return isinstance(entry, list) and len(entry) > i and isinstance(entry[i], int)
