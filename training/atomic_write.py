"""Crash-safe safetensors writes, and output names that never overwrite and never leave the output folder.

A file is written to a temp file beside its target, fsynced, then renamed into place (and the folder fsynced), so a
reader (ComfyUI's LoraLoader, a resumed run) sees the old file or the new one, never half of one; a failed write
removes its temp file. Temp names end in ".tmp", so ComfyUI never lists them as models.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from safetensors.torch import save_file
from torch import Tensor

# Characters Windows forbids in names (':' would also open an NTFS alternate stream): refused on every OS, so a
# workflow written on Linux still saves on Windows.
_FORBIDDEN_CHARS = set('<>:"|?*')


def atomic_save_file(tensors: dict[str, Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None,
                     *, overwrite: bool = True) -> Path:
    """Write `tensors` (and string `metadata`) to the safetensors file `path`, atomically.

    overwrite=False never replaces an existing file, even one created by another process meanwhile: FileExistsError.
    A failure leaves any previous file at `path` as it was and removes the temp file."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"atomic_save_file path {str(path)!r} does not end in .safetensors: only safetensors files "
                         "are written; give a name ending in .safetensors")
    _check_metadata(metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:  # save_file has closed it; flush the OS cache to disk before the rename
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # makes the rename itself durable
    return path


def _publish_new(tmp: str, path: Path) -> None:
    """Rename tmp to path only if path does not exist. A hard link fails atomically on an existing name."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: check, then rename (a tiny race, but no silent loss)
        if path.exists():
            raise FileExistsError(f"{path} already exists") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    if os.name == "nt":  # Windows cannot open a directory for fsync; NTFS journals the rename
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some network/FUSE file systems refuse a directory fsync; the file itself is complete
        pass


def _check_metadata(metadata: dict[str, str] | None) -> None:
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata[{k!r}] = {v!r} ({type(v).__name__}): safetensors metadata keys and values "
                            "must be strings; convert it with str() or json.dumps()")


def safe_output_path(root: str | os.PathLike, prefix: str) -> Path:
    """`root`/`prefix` for a user-given filename_prefix (subfolders allowed), refusing anything that could land
    outside `root`: '..', absolute paths, drives, NUL/control and Windows-forbidden characters."""
    if not isinstance(prefix, str) or not prefix.strip():
        raise ValueError(f"filename_prefix={prefix!r} is empty: give a file name such as 'tightrope/my_lora'")
    bad = sorted({c for c in prefix if c in _FORBIDDEN_CHARS or ord(c) < 32})
    if bad:
        raise ValueError(f"filename_prefix={prefix!r} contains {', '.join(map(repr, bad))}: use letters, digits, "
                         "'_', '-', '.', and '/' for subfolders")
    if PurePosixPath(prefix).is_absolute() or PureWindowsPath(prefix).is_absolute() \
            or PureWindowsPath(prefix).drive or prefix.startswith(("/", "\\")):
        raise ValueError(f"filename_prefix={prefix!r} is an absolute path: give a name relative to the output "
                         f"folder, e.g. 'tightrope/my_lora' (files go under {os.fspath(root)})")
    parts = re.split(r"[/\\]", prefix)
    # '..' and also '...'/'.. ', which Windows trims to '..'
    if any(p not in ("", ".") and not p.rstrip(". ") for p in parts):
        raise ValueError(f"filename_prefix={prefix!r} contains '..': subfolders may only go down, e.g. "
                         "'tightrope/my_lora'")
    if not parts[-1] or parts[-1] == ".":
        raise ValueError(f"filename_prefix={prefix!r} ends in a folder, not a file name: add one, e.g. "
                         f"'{prefix.rstrip('/.')}/my_lora'")
    root_norm = os.path.normpath(os.path.abspath(root))
    target = os.path.normpath(os.path.join(root_norm, *[p for p in parts if p not in ("", ".")]))
    if os.path.commonpath([root_norm, target]) != root_norm:  # belt and braces after the checks above
        raise ValueError(f"filename_prefix={prefix!r} would write outside {root_norm}: use a relative name")
    return Path(target)


def next_free_path(folder: str | os.PathLike, prefix: str, ext: str = ".safetensors") -> Path:
    """ComfyUI-style counter name `{prefix}_{00001}_{ext}` under `folder`, one above the highest already there (so
    an earlier file is never overwritten, even after deletions in between); creates the prefix's subfolders."""
    base = safe_output_path(folder, prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    # case-insensitive: on Windows/macOS "My_lora_00001_" and "my_lora_00001_" are the same file
    pattern = re.compile(re.escape(base.name) + r"_(\d+)_" + re.escape(ext), re.IGNORECASE)
    used = [int(m.group(1)) for p in base.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    return base.parent / f"{base.name}_{max(used, default=0) + 1:05d}_{ext}"
