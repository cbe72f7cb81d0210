import io
import os
import re
import warnings
from pathlib import Path

import pytest
from PIL import Image
from png_decodes import count_png_decodes

from tightrope.training.data.image_folder import (DatasetError, folder_fingerprint, load_image, read_caption,
                                             read_image_header, read_image_size, scan_folder)


def _image(path, size=(16, 16), colour="red", caption="a red square", mode="RGB", **save):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path, **save)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def _says(error, *parts):
    message = str(error.value)
    for part in parts:
        assert str(part) in message, f"{part!r} not in {message!r}"


# -- scanning -----------------------------------------------------------------------------------------

def test_scan_reads_captions_and_kohya_repeats(tmp_path):
    _image(tmp_path / "root.png", caption="  root\nimage  ")
    _image(tmp_path / "10_mychar" / "a.jpg", caption="a")
    _image(tmp_path / "10_mychar" / "deeper" / "b.webp", caption="b")
    _image(tmp_path / "plain" / "c.bmp", caption="c")
    _image(tmp_path / "3_style" / "d.PNG", caption="\ufeffd")
    _image(tmp_path / ".hidden" / "e.png")
    (tmp_path / "notes.json").write_text("{}")
    entries = {e.path.relative_to(tmp_path).as_posix(): (e.caption, e.repeats) for e in scan_folder(tmp_path)}
    assert entries == {"root.png": ("root image", 1), "10_mychar/a.jpg": ("a", 10),
                       "10_mychar/deeper/b.webp": ("b", 10), "plain/c.bmp": ("c", 1), "3_style/d.PNG": ("d", 3)}



def test_a_linked_subfolder_is_scanned_and_a_link_loop_ends(tmp_path):
    """A kohya folder linked in from elsewhere (kohya's listing follows it) is trained with its repeats, not silently
    left out; a link back up (a loop) is not followed forever; the same folder linked twice counts under each name."""
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    _image(data / "a.png", caption="a")
    _image(elsewhere / "l.png", caption="linked")
    (data / "10_char").symlink_to(elsewhere, target_is_directory=True)
    (data / "2_again").symlink_to(elsewhere, target_is_directory=True)
    (data / "10_char" / "loop").symlink_to(data, target_is_directory=True)
    entries = {e.path.relative_to(data).as_posix(): (e.caption, e.repeats) for e in scan_folder(data)}
    assert entries == {"a.png": ("a", 1), "10_char/l.png": ("linked", 10), "2_again/l.png": ("linked", 2)}
    before = folder_fingerprint(data)
    _image(elsewhere / "m.png", caption="added in the linked folder")
    assert folder_fingerprint(data) != before  # the node's IS_CHANGED sees it


def test_a_file_name_that_is_not_utf8_is_fingerprinted(tmp_path):
    """A name of bytes that are not UTF-8 (a Latin-1 'café.png' copied from an old archive: Linux keeps the bytes,
    Python gives it as a surrogate escape) raised UnicodeEncodeError in the node's IS_CHANGED, which ComfyUI logs and
    treats as changed: the dataset was loaded again at every prompt."""
    _image(tmp_path / "a.png", caption="a")
    odd = os.path.join(os.fsencode(tmp_path), b"caf\xe9.png")
    with open(odd, "wb") as f:
        f.write(b"x")
    before = folder_fingerprint(tmp_path)
    assert not before.startswith("unreadable") and folder_fingerprint(tmp_path) == before
    os.utime(odd, ns=(0, 0))
    assert folder_fingerprint(tmp_path) != before  # the file is part of it


def test_missing_folder(tmp_path):
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path / "nope")
    _says(e, tmp_path / "nope", "does not exist", "pass the folder that holds your images")
    assert "working directory" not in str(e.value)


def test_a_missing_relative_folder_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """In ComfyUI a relative folder is taken from the server's working directory, which the user may not know."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError) as e:
        scan_folder("data/good")
    _says(e, "dataset folder 'data/good' does not exist (relative to the working directory: "
          f"{Path.cwd() / 'data' / 'good'})", "pass the folder")


def test_a_folder_under_an_unknown_users_home_is_a_dataset_error():
    """'~nosuchuser/x': pathlib raised a RuntimeError (a traceback in the node's input check)."""
    with pytest.raises(DatasetError) as e:
        scan_folder("~tightrope_no_such_user/images")
    _says(e, "dataset folder '~tightrope_no_such_user/images' starts with '~tightrope_no_such_user', a user whose "
          "home folder this machine does not know: give the folder's full path")
    assert folder_fingerprint("~tightrope_no_such_user/images").startswith("unreadable: ")


def test_an_image_link_to_a_missing_file_is_reported_not_ignored(tmp_path):
    """A dataset of links whose targets moved trained on the rest without a word, even with strict on."""
    _image(tmp_path / "a.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "moved" / "b.png")
    (tmp_path / "b.txt").write_text("b")
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path)
    _says(e, f"image '{tmp_path / 'b.png'}' is a link to '{tmp_path / 'moved' / 'b.png'}', which does not exist",
          "fix or remove the link")
    with pytest.warns(UserWarning, match="skipping an image .strict=False.: image .* is a link to"):
        assert [p.name for p in (e.path for e in scan_folder(tmp_path, strict=False))] == ["a.png"]


def test_folder_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path / "f")
    _says(e, tmp_path / "f", "not a folder")


def test_empty_folder_names_unsupported_formats(tmp_path):
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path)
    _says(e, tmp_path, "has no images", ".png", ".txt caption")
    Image.new("RGB", (4, 4)).save(tmp_path / "anim.gif")
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path)
    _says(e, tmp_path / "anim.gif", "convert them to PNG or JPEG")


def test_zero_repeat_folder(tmp_path):
    _image(tmp_path / "0_x" / "a.png")
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path)
    _says(e, tmp_path / "0_x", "at least 1", "1_x")


def test_a_folder_named_like_a_year_is_warned_of_once(tmp_path):
    """'2024_holiday' is kohya's 2024 repeats: likely a date, so it is named (once, not per image)."""
    _image(tmp_path / "2024_holiday" / "a.png")
    _image(tmp_path / "2024_holiday" / "b.png")
    _image(tmp_path / "20_style" / "c.png")
    with pytest.warns(UserWarning, match=r"'2024_holiday' \(2024x\) repeat their images") as caught:
        entries = scan_folder(tmp_path)
    assert sorted(e.repeats for e in entries) == [20, 2024, 2024] and len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scan_folder(tmp_path, use_repeats=False)  # the caller ignores the counts: nothing to warn of


def test_missing_caption(tmp_path):
    _image(tmp_path / "a.png", caption=None)
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path)
    _says(e, tmp_path / "a.png", "no caption file", "write its caption into", tmp_path / "a.txt")


@pytest.mark.parametrize("content", [b"", b"  \n\t "])
def test_empty_caption_is_an_error(tmp_path, content):
    _image(tmp_path / "a.png", caption=None)
    (tmp_path / "a.txt").write_bytes(content)
    with pytest.raises(DatasetError) as e:
        read_caption(tmp_path / "a.png")
    _says(e, tmp_path / "a.txt", "is empty", "write a caption", "caption_dropout")


def test_caption_not_utf8(tmp_path):
    _image(tmp_path / "a.png", caption=None)
    (tmp_path / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DatasetError) as e:
        scan_folder(tmp_path)
    _says(e, tmp_path / "a.txt", "not valid UTF-8", "offset 3", "re-save it with UTF-8")


def test_non_strict_skips_problems_with_a_warning_but_not_everything(tmp_path):
    _image(tmp_path / "good.png")
    _image(tmp_path / "nocap.png", caption=None)
    with pytest.warns(UserWarning, match=re.escape(str(tmp_path / "nocap.png"))):
        entries = scan_folder(tmp_path, strict=False)
    assert [e.path.name for e in entries] == ["good.png"]
    (tmp_path / "good.txt").unlink()
    with pytest.warns(UserWarning), pytest.raises(DatasetError) as e:
        scan_folder(tmp_path, strict=False)
    _says(e, tmp_path, "no usable images", "all 2 were skipped", "first problem", "good.png")


# -- loading ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"not an image at all", "truncated"])
def test_unreadable_image(tmp_path, content):
    path = tmp_path / "bad.png"
    if content == "truncated":
        buffer = io.BytesIO()
        Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, "PNG")
        content = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    path.write_bytes(content)
    with pytest.raises(DatasetError) as e:
        load_image(path)
    _says(e, path, "cannot read image", "re-export it", "strict=False")


def test_decompression_bomb_guard_is_an_error_not_a_warning(tmp_path, monkeypatch):
    path = _image(tmp_path / "big.png", size=(64, 64))
    with pytest.raises(DatasetError) as e:
        load_image(path, max_pixels=1000)
    _says(e, path, "64x64", "decompression bombs", "downscale it to at most 1000 pixels")
    with pytest.raises(DatasetError):
        read_image_size(path, max_pixels=1000)
    # PIL's own thresholds: its warning is silenced, its error becomes ours.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_image(path).size == (64, 64)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(DatasetError) as e:
        load_image(path)
    _says(e, path, "decompression bombs")


def test_exif_orientation_is_honoured(tmp_path):
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste(Image.new("RGB", (20, 20), (0, 0, 255)), (20, 0))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif, quality=95)
    assert read_image_size(path) == (20, 40)
    loaded = load_image(path)
    assert loaded.size == (20, 40)
    top, bottom = loaded.getpixel((10, 5)), loaded.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60


def test_modes_convert_to_rgb(tmp_path):
    # Transparent pixels composite onto white; 16-bit greyscale scales down instead of clipping.
    _image(tmp_path / "rgba.png", mode="RGBA", colour=(255, 0, 0, 0))
    _image(tmp_path / "la.png", mode="LA", colour=(0, 128))
    _image(tmp_path / "i16.png", mode="I;16", colour=128 * 257)
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.save(tmp_path / "pal_transparent.png", transparency=1)
    palette.save(tmp_path / "pal.png")
    _image(tmp_path / "cmyk.jpg", mode="CMYK", colour=(0, 0, 0, 0), quality=100)
    expected = {"rgba.png": (255, 255, 255), "la.png": (128, 128, 128), "i16.png": (128, 128, 128),
                "pal_transparent.png": (255, 255, 255), "pal.png": (0, 255, 0), "cmyk.jpg": (255, 255, 255)}
    for name, rgb in expected.items():
        image = load_image(tmp_path / name)
        assert image.mode == "RGB", name
        assert all(abs(a - b) <= 2 for a, b in zip(image.getpixel((2, 2)), rgb)), (name, image.getpixel((2, 2)))


def _with_chunk_before_iend(png: bytes, kind: bytes, data: bytes) -> bytes:
    import struct
    import zlib
    chunk = struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return png[:-12] + chunk + png[-12:]  # IEND is the last 12 bytes


@pytest.mark.parametrize("exif_in_header", [False, True])
def test_a_png_header_read_does_not_decode_the_image(tmp_path, monkeypatch, exif_in_header):
    """Pillow's PNG getexif() decodes the whole image (0.1 s for 4 MP) unless the header has an eXIf chunk: a header
    read (the size, orientation and frames, read up to twice per image per run) must not."""
    path = tmp_path / "a.png"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (40, 20)).save(path, **({"exif": exif} if exif_in_header else {}))
    decodes = count_png_decodes(monkeypatch)
    assert read_image_header(path) == (((20, 40) if exif_in_header else (40, 20)), False)
    assert read_image_header(path, data=path.read_bytes())[0] == ((20, 40) if exif_in_header else (40, 20))
    assert decodes == []


@pytest.mark.parametrize("kind", [b"eXIf", b"iTXt"])
def test_png_orientation_after_the_pixel_data_is_still_honoured(tmp_path, kind):
    """EXIF (or XMP) orientation may follow a PNG's pixel data; the header read then agrees with the decode."""
    buffer = io.BytesIO()
    Image.new("RGB", (40, 20), (255, 0, 0)).save(buffer, format="PNG")
    if kind == b"eXIf":
        exif = Image.Exif()
        exif[0x0112] = 6
        data = exif.tobytes()
    else:
        xmp = '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
        data = b"XML:com.adobe.xmp\0\0\0\0\0" + xmp.encode()
    path = tmp_path / "late.png"
    path.write_bytes(_with_chunk_before_iend(buffer.getvalue(), kind, data))
    assert load_image(path).size == (20, 40)
    assert read_image_size(path) == (20, 40)
    assert read_image_size(path, data=path.read_bytes()) == (20, 40)


def test_images_of_one_name_in_two_formats_sharing_a_caption_are_named(tmp_path):
    """'a.png' and 'a.jpg' both train, with the one 'a.txt': most often an export left twice, which doubled that
    image's weight without a word (found by a helper's dataset survey)."""
    _image(tmp_path / "a.png", caption="a cat")
    Image.new("RGB", (8, 8)).save(tmp_path / "a.jpg")
    _image(tmp_path / "b.png", caption="a dog")
    with pytest.warns(UserWarning, match=r"1 caption file\(s\) each serve images of one name in several formats, "
                                         r"which all train: '[^']*a\.jpg' and '[^']*a\.png': delete the copies"):
        entries = scan_folder(tmp_path)
    assert [e.path.name for e in entries] == ["a.jpg", "a.png", "b.png"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (tmp_path / "a.jpg").unlink()
        scan_folder(tmp_path)  # one image per name: nothing said
