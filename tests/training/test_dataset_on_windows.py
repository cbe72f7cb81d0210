"""One dataset folder, the same samples in the same order and the same captions on every OS. Simulated here on
Linux: Windows' pathlib compares paths ignoring case (so sorted(paths) put 'a.png' before 'B.png' there, after it
here), and its file system finds 'image.txt' for 'Image.txt' (case-insensitive), which Linux does not."""
import os
import pathlib

import pytest
from PIL import Image

from tightrope.training.data.image_folder import DatasetError, check_dataset_folder, folder_fingerprint, scan_folder
from tightrope.training.data.masks import find_masks

NAMES = ["B.png", "a.png", "_x.png", "Z.png", "10_Char/x.png", "1_char/y.png", "a/b.png", "a.b.png"]


def _image(path, caption):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), "red").save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")



def _order(folder):
    return [e.path.relative_to(folder).as_posix() for e in scan_folder(folder, use_repeats=False)]


def test_the_sample_order_is_the_same_as_on_windows(tmp_path, monkeypatch):
    for name in NAMES:
        _image(tmp_path / name, name)
    here, fingerprint = _order(tmp_path), folder_fingerprint(tmp_path)
    assert here == ["10_Char/x.png", "1_char/y.png", "B.png", "Z.png", "_x.png", "a/b.png", "a.b.png", "a.png"]
    monkeypatch.setattr(pathlib.PurePath, "__lt__", lambda a, b: [p.lower() for p in a.parts] < [p.lower()
                                                                                                for p in b.parts])
    assert sorted([pathlib.Path("B.png"), pathlib.Path("a.png")]) == [pathlib.Path("a.png"), pathlib.Path("B.png")]
    assert _order(tmp_path) == here
    assert folder_fingerprint(tmp_path) == fingerprint


@pytest.mark.parametrize("image, caption", [("Image.PNG", "image.txt"), ("a.png", "a.TXT"), ("IMG_1.jpg", "img_1.Txt")])
def test_a_caption_named_in_another_case_is_found_as_windows_finds_it(tmp_path, image, caption):
    _image(tmp_path / image, None)
    (tmp_path / caption).write_bytes(b"a red\r\nsquare\r\n")
    [entry] = scan_folder(tmp_path)
    assert entry.caption == "a red square"


def test_the_exact_name_wins_and_two_other_cases_are_refused(tmp_path):
    _image(tmp_path / "a.png", "exact")
    (tmp_path / "A.txt").write_text("other case", encoding="utf-8")
    assert [e.caption for e in scan_folder(tmp_path)] == ["exact"]
    (tmp_path / "a.txt").unlink()
    (tmp_path / "a.TXT").write_text("third", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"has 2 files named 'a.txt' but for case \(A.txt, a.TXT\): keep one"):
        scan_folder(tmp_path)


def test_a_mask_named_in_another_case_is_found(tmp_path):
    _image(tmp_path / "a.png", "a")
    Image.new("L", (8, 8), 255).save(tmp_path / "a.MASK.PNG")
    entries = scan_folder(tmp_path)
    assert [e.path.name for e in entries] == ["a.png"]
    assert find_masks(entries, "mask_files", 10**8)[entries[0].path].path.name == "a.MASK.PNG"


def test_a_folder_pasted_with_the_quotes_of_windows_copy_as_path_loads(tmp_path):
    """Explorer's "Copy as path" (Ctrl+Shift+C) gives '"C:\\Users\\me\\data"'; before, 'does not exist (relative to the
    working directory: ...)'."""
    _image(tmp_path / "a.png", "a")
    quoted = f'"{tmp_path}"'
    assert check_dataset_folder(quoted) == tmp_path
    assert [e.caption for e in scan_folder(quoted)] == ["a"]
    assert folder_fingerprint(quoted) == folder_fingerprint(tmp_path)


def test_a_folder_link_back_up_is_not_followed_again_where_entries_have_no_inode(tmp_path, monkeypatch):
    """On Windows os.DirEntry.stat() leaves st_ino and st_dev 0 except for a symlink: a junction (mklink /J, what
    Windows users make: no admin rights needed) back to a folder above was entered again and again, each image listed
    once per level, until the path grew too long (or Python's recursion limit). Simulated: entries report no inode."""
    from tightrope.training.data import image_folder

    class WindowsEntry:
        def __init__(self, entry):
            self._entry, self.name, self.path = entry, entry.name, entry.path

        def is_dir(self):
            return self._entry.is_dir()

        def stat(self):
            st = self._entry.stat()
            return os.stat_result((st.st_mode, 0, 0) + tuple(st)[3:])
    real_scandir = os.scandir
    monkeypatch.setattr(image_folder.os, "scandir", lambda folder: [WindowsEntry(e) for e in real_scandir(folder)])
    _image(tmp_path / "1_a" / "x.png", "x")
    (tmp_path / "1_a" / "loop").symlink_to(tmp_path / "1_a", target_is_directory=True)
    assert _order(tmp_path) == ["1_a/x.png"]
