"""Crash-safe safetensors writes, and output names that never overwrite and never leave the output folder.

A file is serialized in memory, written to a temp file beside its target, fsynced, then renamed into place (and the
folder fsynced), so a reader (ComfyUI's LoraLoader, a resumed run) sees the old file or the new one, never half of
one; a failed write removes its temp file and raises FileWriteError naming the target. We write the bytes ourselves
rather than through safetensors' save_file, which (0.7+) writes its own 0600 ".tmpXXXXXX" beside the target: so
every temp file is ours, named ".<name>.<8 random>.tmp" (ComfyUI never lists it as a model) and locked by its
writer (POSIX) until renamed, so one left by a killed process (kill -9, power cut) can be told from one being
written, and removed (remove_stale_temporaries); and the file gets the mode the user's umask gives any new file
(0644 under umask 022), like ComfyUI's images. The in-memory copy costs the file's size once (LoRA, training state
and cache files are small next to the model).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import secrets
import time
import unicodedata
from pathlib import Path, PurePosixPath, PureWindowsPath

from safetensors.torch import save
from torch import Tensor

from ..train_config import ConfigError


class OutputPathError(ConfigError):
    """A file name or output folder cannot be written; the message names the input and the fix."""

try:
    import fcntl
except ImportError:  # Windows: an open file cannot be deleted there, so a live writer's temp file is safe anyway
    fcntl = None

# Characters Windows forbids in names (':' would also open an NTFS alternate stream): refused on every OS, so a
# workflow written on Linux still saves on Windows.
_FORBIDDEN_CHARS = set('<>:"|?*')
# Names Windows gives to devices, in any case and with any extension ('NUL.state.safetensors' is NUL): a folder or a
# training state file ('<prefix>.node-<id>.state.safetensors') so named cannot be made there. Refused on every OS, as
# the characters above.
_WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$",
                    *(f"{port}{n}" for port in ("COM", "LPT") for n in (*"0123456789", "\u00b9", "\u00b2", "\u00b3"))}
# our temp files (and those of tempfile.mkstemp, which earlier versions used): ".<name>.safetensors.<8 chars>.tmp"
_TEMP_NAME = re.compile(r"\..+\.safetensors\.[a-z0-9_]{8}\.tmp")
_FIXES = {errno.ENOSPC: "free disk space there or choose another folder",
          errno.EDQUOT: "free space in your disk quota or choose another folder",
          errno.EACCES: "make the folder writable or choose another folder",
          errno.EPERM: "make the folder writable or choose another folder",
          errno.EROFS: "the file system is read-only: choose another folder",
          errno.ENAMETOOLONG: "the file or folder name is too long for the file system: choose a shorter "
                              "filename_prefix or a folder with a shorter path"}
# A file name may have 255 bytes (ext4, XFS, btrfs, APFS, NTFS: 255 UTF-16 units). A run adds to the prefix's last
# part up to about 70 bytes (the temp file of a rescued LoRA: ".tightrope_rescue_<name>_step<step>_00001_
# .safetensors.<8 hex>.tmp"; a state file: ".<name>.node-<id>.state.safetensors.<8 hex>.tmp"), plus a node id: the
# rest is the prefix's.
NAME_MAX_BYTES = 255
PREFIX_NAME_MAX_BYTES = 150


# Windows where long paths are not enabled: a file's full path may have 259 characters (MAX_PATH less its NUL), a
# folder's 247 (room for an 8.3 name). Longer ones fail as if missing: FileNotFoundError "[WinError 3] The system
# cannot find the path specified" (or 206, "The filename or extension is too long").
WINDOWS_MAX_PATH, WINDOWS_MAX_FOLDER = 259, 247
LONG_PATHS_FIX = ("enable long paths in Windows (as administrator: reg add "
                  "HKLM\\SYSTEM\\CurrentControlSet\\Control\\FileSystem /v LongPathsEnabled /t REG_DWORD /d 1 /f, "
                  "then restart ComfyUI), or use a shorter path: a shorter filename_prefix, ComfyUI in a folder nearer "
                  "the drive's root (C:\\ComfyUI), or its --user-directory and --output-directory (headless: "
                  "--output-dir) in shorter folders")


@functools.cache
def windows_short_paths() -> bool:
    """Whether paths are limited to WINDOWS_MAX_PATH here: Windows with long paths not enabled (the registry's
    LongPathsEnabled; python.exe's manifest opts in, so ntdll's answer is the registry's)."""
    if os.name != "nt":
        return False
    try:
        enabled = ctypes.WinDLL("ntdll").RtlAreLongPathsEnabled
        enabled.restype = ctypes.c_ubyte  # a BOOLEAN
        return not enabled()
    except (OSError, AttributeError):  # before Windows 10 1607: no long paths at all
        return True


def long_path_problem(path: str | os.PathLike) -> str | None:
    """Why `path`, a file to create, cannot be where paths are limited (windows_short_paths); None where it can."""
    if not windows_short_paths():
        return None
    full = os.path.abspath(path)
    if full.startswith("\\\\?\\"):  # an extended-length path (\\?\C:\...) has no such limit
        return None
    if len(full) > WINDOWS_MAX_PATH or len(os.path.dirname(full)) > WINDOWS_MAX_FOLDER:
        return (f"longer than the {WINDOWS_MAX_PATH} characters Windows allows in a path (a folder's: "
                f"{WINDOWS_MAX_FOLDER}) where long paths are not enabled")
    return None


# Windows: a file another program holds open (an antivirus or the search indexer reading the file just written, a
# viewer, ComfyUI's loader) cannot be replaced or deleted meanwhile: PermissionError (WinError 5 or 32). Scanners let
# go within seconds, so there a rename is tried again for a while (as uv and npm do) before the write fails.
_IN_USE_RETRIES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0) if os.name == "nt" else ()
IN_USE_FIX = ("another program holds it open and Windows cannot replace a file in use (an antivirus scan, a viewer, "
              "a loader): close that program and run again, or choose another filename_prefix or folder")


class FileWriteError(OSError):
    """A file could not be written (disk full, no permission, ...): the message names it, the fix, and what was kept
    (`kept`, when the caller knows); errno is the cause's. Any earlier file at that path is unchanged and no temp
    file is left."""

    def __init__(self, path: Path, code: int | None, reason: str, *, kept: str = "", fix: str | None = None):
        fix = fix or _FIXES.get(code, "check that the folder exists and is writable")
        super().__init__(f"could not write '{path}' ({reason}): {fix}" + (f"; {kept}" if kept else ""))
        self.errno, self.strerror, self.path, self.fix, self.kept = code, reason, Path(path), fix, kept

    def __str__(self) -> str:
        return self.args[0]


def atomic_save_file(tensors: dict[str, Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None,
                     *, overwrite: bool = True) -> Path:
    """Write `tensors` (and string `metadata`) to the safetensors file `path`, atomically.

    overwrite=False never replaces an existing file, even one created by another process meanwhile: FileExistsError.
    A failure leaves any previous file at `path` as it was and removes the temp file; an I/O failure (disk full,
    permissions) raises FileWriteError naming `path`."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"atomic_save_file path {str(path)!r} does not end in .safetensors: only safetensors files "
                         "are written; give a name ending in .safetensors")
    _check_metadata(metadata)
    too_long = long_path_problem(path.with_name(f".{path.name}.{'0' * 8}.tmp"))  # the temp file's name is longer
    if too_long:
        raise FileWriteError(path, errno.ENAMETOOLONG, f"its path, with its temp file's name, is {too_long}",
                             fix=LONG_PATHS_FIX)
    fd, tmp = None, None
    try:
        data = save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata=metadata)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(path)
        if fcntl is not None:  # held until the file is renamed: marks it as being written
            fcntl.flock(fd, fcntl.LOCK_EX)
        _write_all(fd, data)
        os.fsync(fd)  # on disk before the rename
        if os.name == "nt":  # Windows cannot rename an open file
            os.close(fd)
            fd = None
        if overwrite:
            _replace(tmp, path)
        else:
            _publish_new(tmp, path)
    except BaseException as e:
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # Windows: still open elsewhere; the next run removes it (remove_stale_temporaries)
                pass
        failure = _as_write_error(path, e)
        if failure is not None:
            raise failure from e
        raise
    finally:
        if fd is not None:
            os.close(fd)
    _fsync_dir(path.parent)  # makes the rename itself durable
    return path


def remove_stale_temporaries(folder: str | os.PathLike, *, older_than: float) -> list[Path]:
    """Delete the temp files this writer left in `folder` when its process was killed: only names it makes, last
    modified before `older_than` (a time.time(), the run's start) and not locked by a live writer (another run
    writing into the same folder keeps its lock until it has renamed its file). Returns the removed paths."""
    try:
        entries = [e for e in os.scandir(folder) if _TEMP_NAME.fullmatch(e.name)]
    except OSError:  # no such folder yet, or unreadable: nothing of ours to remove
        return []
    removed = []
    for entry in entries:
        try:
            if not entry.is_file(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_mtime >= older_than:
                continue
            if _remove_unless_locked(Path(entry.path)):
                removed.append(Path(entry.path))
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    return removed


def _remove_unless_locked(path: Path) -> bool:
    if fcntl is None:  # Windows refuses to delete a file another process has open
        path.unlink()
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer
        path.unlink()
        return True
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty temp file beside `path`. Unlike tempfile.mkstemp (always 0600) os.open's mode goes through the
    umask, so the renamed file gets the mode any file the user creates gets."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temp file beside {path}: 100 random names were taken")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _as_write_error(path: Path, e: BaseException) -> FileWriteError | None:
    """An OSError as a FileWriteError naming `path`; None for anything else (FileExistsError included, which
    save_lora_state uses to pick the next free name)."""
    if not isinstance(e, OSError) or isinstance(e, (FileExistsError, FileWriteError)):
        return None
    return FileWriteError(path, e.errno, e.strerror or str(e))


def _publish_new(tmp: str, path: Path) -> None:
    """Rename tmp to path only if path does not exist. A hard link fails atomically on an existing name."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: check, then rename (a tiny race, but no silent loss)
        if path.exists():
            raise FileExistsError(f"{path} already exists") from None
        _replace(tmp, path)
        return
    try:
        _when_free(os.unlink, tmp)
    except OSError:  # the file is in place; the temp name left is removed by the next run (remove_stale_temporaries)
        pass


def _when_free(action, *args) -> None:
    """`action(*args)` (a rename or delete), tried again while Windows says the file is in use (_IN_USE_RETRIES)."""
    for delay in _IN_USE_RETRIES:
        try:
            return action(*args)
        except PermissionError:
            time.sleep(delay)
    action(*args)


def _replace(tmp: Path, path: Path) -> None:
    try:
        _when_free(os.replace, tmp, path)
    except PermissionError as e:
        if not _IN_USE_RETRIES:  # elsewhere a permission is what is missing
            raise
        raise FileWriteError(path, e.errno, e.strerror or str(e), fix=IN_USE_FIX) from e


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


def safe_output_path(root: str | os.PathLike, prefix: str, name: str = "filename_prefix",
                     example: str = "tightrope/my_lora") -> Path:
    """`root`/`prefix` for a user-given filename_prefix (subfolders allowed), refusing anything that could land
    outside `root`: '..', absolute paths, drives, NUL/control and Windows-forbidden characters. `name` and `example`:
    the input the messages name and the value they suggest (a folder input: its trailing '/' is allowed)."""
    given = prefix
    if name != "filename_prefix" and isinstance(prefix, str) and prefix.rstrip("/\\"):
        prefix = prefix.rstrip("/\\")  # a folder
    if not isinstance(prefix, str) or not prefix.strip():
        raise OutputPathError(f"{name}={prefix!r} is empty: give a {'file ' * (name == 'filename_prefix')}name such as '{example}'")
    bad = sorted({c for c in prefix if c in _FORBIDDEN_CHARS or ord(c) < 32})
    if bad:
        raise OutputPathError(f"{name}={prefix!r} contains {', '.join(map(repr, bad))}: use letters, digits, "
                         "'_', '-', '.', and '/' for subfolders")
    if PurePosixPath(prefix).is_absolute() or PureWindowsPath(prefix).is_absolute() \
            or PureWindowsPath(prefix).drive or prefix.startswith(("/", "\\")):
        raise OutputPathError(f"{name}={prefix!r} is an absolute path: give a name relative to the folder files "
                              f"go under ({os.fspath(root)}), e.g. '{example}'")
    parts = re.split(r"[/\\]", prefix)
    if parts[0].startswith("~"):  # '~/loras/x' is not the home folder here: it would make a folder named '~'
        raise OutputPathError(f"{name}={prefix!r} starts with '~': it is a name relative to the folder files go "
                              f"under ({os.fspath(root)}), not a home folder; e.g. '{example}'")
    # '..' and also '...'/'.. ', which Windows trims to '..'
    if any(p not in ("", ".") and not p.rstrip(". ") for p in parts):
        raise OutputPathError(f"{name}={prefix!r} contains '..': subfolders may only go down, e.g. "
                         f"'{example}'")
    device = next((p for p in parts if p.split(".")[0].rstrip(" ").upper() in _WINDOWS_DEVICES), None)
    if device is not None:
        raise OutputPathError(f"{name}={prefix!r} contains {device!r}, a name Windows reserves for a device (CON, PRN, "
                              "AUX, NUL, COM1-9, LPT1-9, with any extension), under which it cannot save: choose "
                              f"another name, e.g. '{example}'")
    if (not parts[-1] or parts[-1] == ".") and name != "filename_prefix":
        raise OutputPathError(f"{name}={given!r} is the output folder itself: give a folder inside it, e.g. "
                              f"'{example}'")
    if not parts[-1] or parts[-1] == ".":
        folder = prefix.rstrip("/.")
        raise OutputPathError(f"{name}={prefix!r} ends in a folder, not a file name: add one, e.g. "
                              f"'{folder + '/' if folder else ''}my_lora'")
    for size in (len(part.encode("utf-8", "surrogatepass")) for part in parts):
        if size > NAME_MAX_BYTES:
            raise OutputPathError(f"{name}={_shown(prefix)} is too long: a name in it has {size} bytes, "
                                  f"more than the {NAME_MAX_BYTES} a file system allows: choose a shorter name")
    root_norm = os.path.normpath(os.path.abspath(root))
    target = os.path.normpath(os.path.join(root_norm, *[p for p in parts if p not in ("", ".")]))
    if os.path.commonpath([root_norm, target]) != root_norm:  # belt and braces after the checks above
        raise OutputPathError(f"{name}={prefix!r} would write outside {root_norm}: use a relative name")
    return Path(target)


def user_output_path(root: str | os.PathLike, prefix: str) -> Path:
    """safe_output_path for a prefix a user gave, whose last part is short enough for every file a run names after
    it (PREFIX_NAME_MAX_BYTES): checked when a workflow is queued, so a long name does not fail only at the save."""
    target = safe_output_path(root, prefix)
    size = len(target.name.encode("utf-8", "surrogatepass"))
    if size > PREFIX_NAME_MAX_BYTES:
        raise OutputPathError(f"filename_prefix={_shown(prefix)} is too long: its file name has {size} bytes, at most "
                              f"{PREFIX_NAME_MAX_BYTES} fit (the saved files add a counter and suffixes to it, and a "
                              f"file name may have {NAME_MAX_BYTES} bytes): choose a shorter name")
    lora = target.with_name(f"{target.name}_00001_.safetensors")
    too_long = long_path_problem(lora.with_name(f".{lora.name}.{'0' * 8}.tmp"))  # the LoRA's temp file
    if too_long:
        raise OutputPathError(f"filename_prefix={_shown(prefix)} saves files such as '{lora}', whose path (with its "
                              f"temp file's name) is {too_long}: {LONG_PATHS_FIX}")
    return target


def _shown(text: str, keep: int = 40) -> str:
    """`text` quoted, its middle elided when long (an error message names a 1000-character prefix in one line)."""
    return repr(text) if len(text) <= 2 * keep else repr(text[:keep] + "..." + text[-keep:])


def next_free_path(folder: str | os.PathLike, prefix: str, ext: str = ".safetensors", *, at_least: int = 1) -> Path:
    """ComfyUI-style counter name `{prefix}_{00001}_{ext}` under `folder`, one above the highest already there (so
    an earlier file is never overwritten, even after deletions in between), and no lower than `at_least` (a file
    that goes with another, e.g. a LoRA's EMA, takes its number); creates the prefix's subfolders."""
    base = safe_output_path(folder, prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    return base.parent / f"{base.name}_{max(next_counter(folder, prefix, ext), at_least):05d}_{ext}"


def next_counter(folder: str | os.PathLike, prefix: str, ext: str = ".safetensors") -> int:
    """The counter next_free_path would give `prefix` in `folder` now: one above the highest there (1 if none)."""
    base = safe_output_path(folder, prefix)
    if not base.parent.is_dir():
        return 1
    # case-insensitive: on Windows/macOS "My_lora_00001_" and "my_lora_00001_" are the same file; and in one Unicode
    # normal form: macOS's HFS+ lists "café" decomposed (NFD) and takes either form for the same file
    pattern = re.compile(re.escape(unicodedata.normalize("NFC", base.name)) + r"_(\d+)_" + re.escape(ext),
                         re.IGNORECASE)
    used = [int(m.group(1)) for p in base.parent.iterdir()
            if (m := pattern.fullmatch(unicodedata.normalize("NFC", p.name)))]
    return max(used, default=0) + 1


def file_counter(path: str | os.PathLike) -> int:
    """The counter in a name next_free_path made (`..._00007_.safetensors` -> 7)."""
    match = re.search(r"_(\d+)_\.[^.]+$", os.fspath(path))
    if match is None:
        raise ValueError(f"{os.fspath(path)!r} has no counter: not a name next_free_path made")
    return int(match.group(1))
