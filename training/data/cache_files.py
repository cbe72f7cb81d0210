"""The dataset's cache folder (dataset.py writes it): content-keyed safetensors under latents/ and text/, each written
once and never changed. Nothing in it goes stale by itself and nothing removes it: a changed resolution, VAE, caption
or image leaves the old entries there. So each load marks the entries it uses (their modification time is set to now,
on a cache hit as on a write: the time an entry was last used, by any dataset), says where the folder is, its size
and how many entries the load did not use (usage_summary), and `tightrope cache DIR --older-than DAYS` lists, or with
--delete removes, the entries no load has used for that long (prune).

Nothing is deleted by itself: several datasets may share one folder (every Load Dataset node of a ComfyUI, every run
of one --output-dir), and one not loaded for a while still wants its entries. A deleted entry that is wanted again
is encoded again on the next load, never read wrong (its name is the hash of what made it)."""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..state.atomic_write import remove_stale_temporaries
from .keys import SHA256_HEX

KINDS = ("latents", "text")  # entry_path: <cache_dir>/<kind>/<2 hex>/<key>.safetensors
DAY = 86400.0


# bits per element of every dtype safetensors writes (its names): an encoder may return any of them (fp8 latents or
# contexts, uint16), and an entry whose dtype were missing here would be taken for damaged and encoded at every load
_ITEM_BITS = {"F64": 64, "I64": 64, "U64": 64, "C64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16, "BF16": 16,
              "I16": 16, "U16": 16, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I8": 8, "U8": 8, "BOOL": 8,
              "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}
_MAX_HEADER = 100_000_000  # safetensors' own limit


def cached_shapes(path: Path, names: tuple[str, ...]) -> dict[str, tuple[int, ...]] | None:
    """Shapes of the named tensors in a cache file, from its header alone; None if missing or not a whole, readable
    file (then it is encoded again). The header is parsed here, not by safe_open: that maps the file, and on a cold
    page cache its read-ahead brought every entry in whole at each load (a T5 context is megabytes). Checked as
    safetensors checks it on load: each tensor's bytes match its dtype and shape, contiguously up to the file's end
    (a truncated entry is encoded again, not found broken at its first training read). A hit marks it used now."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= _MAX_HEADER:
                return None
            header, size = json.loads(f.read(n)), os.fstat(f.fileno()).st_size
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        spans = sorted(tuple(v["data_offsets"]) for v in tensors.values())
        if any(b != a for (_, a), (b, _) in zip([(0, 0)] + spans, spans)) or size != 8 + n + spans[-1][1]:
            return None
        for v in tensors.values():
            begin, end = v["data_offsets"]
            if end - begin != -(-math.prod(v["shape"]) * _ITEM_BITS[v["dtype"]] // 8):  # sub-byte ones: rounded up
                return None
        shapes = {name: tuple(tensors[name]["shape"]) for name in names}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):  # damaged: encoded again
        return None
    mark_used(path)
    return shapes


def read_entry(path: Path) -> dict:
    """An entry's tensors, the entry marked used. One removed after its dataset was loaded (`tightrope cache --delete`
    while ComfyUI kept the dataset) is said so, not a FileNotFoundError's traceback."""
    from safetensors.torch import load_file

    from .image_folder import DatasetError
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise DatasetError(f"dataset cache file '{path}' was removed after this dataset was loaded (`tightrope cache "
                           "--delete`, or the cache folder deleted): load the dataset again (its images and captions "
                           "are encoded again)") from None
    mark_used(path)
    return tensors


def mark_used(path: Path) -> None:
    """The entry's modification time := now, what prune reads as its last use (an entry's bytes never change)."""
    try:
        os.utime(path)
    except OSError:  # a read-only or another user's cache: it is used all the same, only not marked
        pass


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int
    last_used: float  # its modification time: written or last loaded then


_FAN_OUT = re.compile(r"[0-9a-f]{2}")


def entry_path(cache_dir: Path, kind: str, key: str) -> Path:
    """Where the entry `key` (a content_key) of `kind` lives: a two-character fan-out keeps folders small."""
    return cache_dir / kind / key[:2] / f"{key}.safetensors"


def _is_entry(fan_out: str, name: str) -> bool:
    """Whether `name` in folder `fan_out` is named as entry_path names an entry. Nothing else there is the cache's (a
    folder given by mistake keeps its own files)."""
    key = name[:-len(".safetensors")]
    return name.endswith(".safetensors") and key.startswith(fan_out) and SHA256_HEX.fullmatch(key) is not None


def _fan_outs(cache_dir: str | Path, kind: str) -> list[os.DirEntry]:
    return [d for d in _scandir(Path(cache_dir) / kind)
            if _FAN_OUT.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]


def entries(cache_dir: str | Path) -> list[Entry]:
    """Every entry of the cache folder (an unreadable or missing folder has none), sorted by path."""
    found = []
    for kind in KINDS:
        for fan_out in _fan_outs(cache_dir, kind):
            for entry in _scandir(Path(fan_out.path)):
                if _is_entry(fan_out.name, entry.name):
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except OSError:  # removed meanwhile
                        continue
                    found.append(Entry(Path(entry.path), stat.st_size, stat.st_mtime))
    return sorted(found, key=lambda e: e.path)


def _scandir(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as listing:
            return list(listing)
    except OSError:
        return []


def size_text(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def usage_summary(cache_dir: str | Path, used: set[Path], *, days: float = 30, now: float | None = None) -> str:
    """One line for the user after a load: where the cache is, its size, what this load used, and what it did not
    (entries of other datasets sharing the folder, or of earlier settings), with the command that prunes them."""
    now = time.time() if now is None else now
    every = entries(cache_dir)
    used = {os.fspath(p) for p in used}  # strings: hashing 10k Paths costs more than the folder's listing
    unused = [e for e in every if os.fspath(e.path) not in used]
    old = [e for e in unused if now - e.last_used >= days * DAY]
    line = (f"dataset cache '{cache_dir}': {size_text(sum(e.size for e in every))} in {len(every)} entries, "
            f"{len(every) - len(unused)} used by this load")
    if not unused:
        return line
    line += (f"; {len(unused)} others ({size_text(sum(e.size for e in unused))}) are other datasets' or from earlier "
             "settings (resolution, VAE, text encoder, images, captions)")
    if old:
        line += (f", {len(old)} of them ({size_text(sum(e.size for e in old))}) unused for {days:g} days or more: "
                 f"`python -m tightrope cache \"{cache_dir}\" --older-than {days:g}` lists them, and with --delete "
                 "removes them")
    return line


def prune(cache_dir: str | Path, older_than_days: float, *, delete: bool, now: float | None = None) -> list[Entry]:
    """The entries no load has used for older_than_days (removed with delete=True; else only listed), and with
    delete=True the temp files a killed writer left that long ago. An entry used again since it was listed (a load
    running now) is kept: its time is read again just before it is removed."""
    if older_than_days < 0:
        raise ValueError(f"--older-than {older_than_days:g}: give a number of days, 0 or more")
    cutoff = (time.time() if now is None else now) - older_than_days * DAY
    stale = [e for e in entries(cache_dir) if e.last_used < cutoff]
    if not delete:
        return stale
    removed = []
    for entry in stale:
        try:
            if entry.path.stat().st_mtime < cutoff:
                entry.path.unlink()
                removed.append(entry)
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    remove_stale_temporaries(cache_dir, older_than=cutoff)  # the hash index's (image_hashes.py)
    for kind in KINDS:
        for fan_out in _fan_outs(cache_dir, kind):
            remove_stale_temporaries(fan_out.path, older_than=cutoff)
            try:
                os.rmdir(fan_out.path)  # an emptied fan-out folder
            except OSError:
                pass
    return removed


def command(argv: list[str]) -> int:
    """`tightrope cache [DIR] [--older-than DAYS] [--delete]`: the cache's size and what has not been used for DAYS,
    listed (a dry run) unless --delete."""
    import argparse
    parser = argparse.ArgumentParser(
        prog="tightrope cache", description="The dataset cache (encoded images and captions): its size, and the "
        "entries no load has used for DAYS days, listed; with --delete, removed. Several datasets may share one "
        "cache: an entry each uses is marked at each load and each training read, so one in use is not removed, and "
        "a removed one that is wanted again is only encoded again. ComfyUI's cache is ComfyUI/user/tightrope_cache; "
        "a headless run's is .tightrope_cache in its --output-dir.")
    parser.add_argument("dir", nargs="?", default=os.path.join("output", ".tightrope_cache"), metavar="DIR",
                        help="the cache folder (default: output/.tightrope_cache, that of `tightrope run`'s default "
                             "--output-dir)")
    parser.add_argument("--older-than", type=float, default=30.0, metavar="DAYS",
                        help="entries last used at least this many days ago (default: 30)")
    parser.add_argument("--delete", action="store_true", help="remove them (without it nothing is removed)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, or a usage error argparse already printed
        return exit_request.code if isinstance(exit_request.code, int) else 2
    if not Path(args.dir).is_dir():
        print(f"cache folder '{args.dir}' does not exist: give the folder, e.g. ComfyUI/user/tightrope_cache or "
              f"<output-dir>/.tightrope_cache", file=sys.stderr)
        return 2
    try:
        stale = prune(args.dir, args.older_than, delete=args.delete)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    for entry in stale:
        print(entry.path)
    left = [e for e in entries(args.dir) if args.delete or e not in stale]
    print(f"cache '{args.dir}': {len(stale)} entries ({size_text(sum(e.size for e in stale))}) unused for "
          f"{args.older_than:g} days or more {'removed' if args.delete else 'would be removed'}, "
          f"{len(left)} ({size_text(sum(e.size for e in left))}) {'are' if args.delete else 'would be'} left"
          + ("" if args.delete or not stale else ": run again with --delete to remove them"), file=sys.stderr)
    return 0
