"""The dataset cache folder (training/data/cache_files.py): each load marks the entries it uses, says what the folder
holds and what it did not use; `tightrope cache` lists, and with --delete removes, what no load used for a while."""
import os
import time

import pytest

from tightrope import cli
from tightrope.demo.data import make_demo_dataset
from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data import cache_files
from tightrope.training.data.cache_files import entries, prune, usage_summary
from tightrope.training.data.dataset import TrainingDataset

DAY = 86400


def _load(folder, cache, size=32):
    return TrainingDataset(folder, DemoLatentCodec(), DemoCaptionEmbedder(), max_pixels=size * size, cache_dir=cache)


def _age(paths, days):
    then = time.time() - days * DAY
    for path in paths:
        os.utime(path, (then, then))


@pytest.fixture
def two_datasets(tmp_path):
    """Two datasets sharing one cache: 'a' loaded at two resolutions (the first one's latents now unused)."""
    a = make_demo_dataset(tmp_path / "a", n_images=4, size=32, seed=0)
    b = make_demo_dataset(tmp_path / "b", n_images=3, size=32, seed=1)
    cache = tmp_path / "cache"
    old_a, other = _load(a, cache, 16), _load(b, cache)
    return a, b, cache, old_a, other


def test_a_load_marks_what_it_uses_and_says_what_it_did_not_use(two_datasets):
    a, b, cache, old_a, other = two_datasets
    _age([e.path for e in entries(cache)], 40)
    new_a = _load(a, cache)
    assert new_a.encoded_images == 4 and new_a.image_cache_hits == 0
    used = new_a.cache_files()
    every = {e.path: e for e in entries(cache)}
    # 4 latents of each load of 'a', 3 of 'b'; the demo's captions: one text entry each, shared by the two loads
    captions = {old_a.caption(i) for i in range(4)} | {other.caption(i) for i in range(3)}
    assert len(every) == 4 + 4 + 3 + len(captions)
    assert {p for p in used if p.parts[-3] == "latents"} == set(every) - old_a.cache_files() - other.cache_files()
    assert len(used) == 4 + len({new_a.caption(i) for i in range(4)})
    now = time.time()
    assert all(now - every[p].last_used < DAY for p in used)  # hits (the captions) and writes (the latents): now
    assert all(now - e.last_used > 39 * DAY for p, e in every.items() if p not in used)
    size = sum(e.size for e in every.values())
    unused = [e for p, e in every.items() if p not in used]
    assert usage_summary(cache, used) == (
        f"dataset cache '{cache}': {cache_files.size_text(size)} in {len(every)} entries, {len(used)} used by this "
        f"load; {len(unused)} others ({cache_files.size_text(sum(e.size for e in unused))}) are other datasets' or "
        "from earlier settings (resolution, VAE, text encoder, images, captions), "
        f"{len(unused)} of them ({cache_files.size_text(sum(e.size for e in unused))}) unused for 30 days or more: "
        f"`python -m tightrope cache \"{cache}\" --older-than 30` lists them, and with --delete removes them")
    assert usage_summary(cache, set(every)) == (f"dataset cache '{cache}': {cache_files.size_text(size)} in "
                                                f"{len(every)} entries, {len(every)} used by this load")


def test_a_cache_hit_and_a_training_read_mark_the_entry(two_datasets):
    a, b, cache, old_a, other = two_datasets
    _age([e.path for e in entries(cache)], 40)
    again = _load(b, cache)  # all hits
    assert again.image_cache_hits == 3 and all(time.time() - e.last_used < DAY for e in entries(cache)
                                               if e.path in again.cache_files())
    _age(again.cache_files(), 40)
    again.latent(0), again.text(1)  # what a training step reads
    marked = {e.path for e in entries(cache) if time.time() - e.last_used < DAY}
    assert marked <= again.cache_files() and sorted(p.parts[-3] for p in marked) == ["latents", "text"]


def test_prune_lists_by_default_and_removes_only_what_no_load_used_for_that_long(two_datasets, capsys):
    a, b, cache, old_a, other = two_datasets
    _age([e.path for e in entries(cache)], 40)
    _load(b, cache)  # 'b' is in use: its entries are marked now
    stale = {e.path for e in entries(cache)} - _load(b, cache).cache_files()
    before = {e.path for e in entries(cache)}

    assert cli.main(["cache", str(cache), "--older-than", "30"]) == 0  # a dry run
    out, err = capsys.readouterr()
    assert set(out.split("\n")) - {""} == {str(p) for p in stale}
    assert f"cache '{cache}': {len(stale)} entries (" in err
    assert f"would be removed, {len(before) - len(stale)} (" in err
    assert err.rstrip().endswith("would be left: run again with --delete to remove them")
    assert {e.path for e in entries(cache)} == before

    assert cli.main(["cache", str(cache), "--older-than", "50", "--delete"]) == 0  # nothing that old
    assert {e.path for e in entries(cache)} == before and ": 0 entries (0 bytes) unused" in capsys.readouterr().err
    assert cli.main(["cache", str(cache), "--older-than", "30", "--delete"]) == 0
    assert f": {len(stale)} entries (" in capsys.readouterr().err
    assert {e.path for e in entries(cache)} == before - stale
    assert not [p for p in cache.rglob("*") if p.is_dir() and not any(p.iterdir())]  # emptied folders removed

    reloaded = _load(b, cache)  # untouched: all hits
    assert reloaded.image_cache_hits == 3 and reloaded.encoded_images == 0
    old = _load(a, cache, 16)  # pruned: encoded again, read back the same
    assert old.encoded_images == 4
    for i in range(4):
        assert (old.latent(i) == old_a.latent(i)).all()


def test_an_entry_used_after_it_was_listed_is_kept(two_datasets, monkeypatch):
    """A load that hits an entry while prune runs marks it: prune reads its time again before removing it."""
    a, b, cache, old_a, other = two_datasets
    listed = entries(cache)
    _age([e.path for e in listed], 40)
    in_use = other.cache_files()
    stale_list = [cache_files.Entry(e.path, e.size, time.time() - 40 * DAY) for e in listed]
    monkeypatch.setattr(cache_files, "entries", lambda folder: stale_list)
    for path in in_use:
        cache_files.mark_used(path)  # a load hits them after prune listed them
    removed = prune(cache, 30, delete=True)
    assert {e.path for e in removed} == {e.path for e in listed} - in_use
    assert all(p.is_file() for p in in_use)


def test_stale_temp_files_are_removed_with_delete(tmp_path):
    cache = tmp_path / "cache"
    folder = cache / "latents" / "ab"
    folder.mkdir(parents=True)
    temp = folder / ".abcd.safetensors.0123abcd.tmp"  # a writer killed mid-write
    index_temp = cache / ".image_hashes.safetensors.4567cdef.tmp"  # the hash index's (image_hashes.py)
    for path in (temp, index_temp):
        path.write_bytes(b"half")
    _age([temp, index_temp], 2)
    assert prune(cache, 1, delete=False) == [] and temp.exists() and index_temp.exists()
    prune(cache, 1, delete=True)
    assert not temp.exists() and not folder.exists() and not index_temp.exists()


def test_a_wrong_folder_keeps_what_is_not_named_as_a_cache_entry(two_datasets, capsys):
    """Only <2 hex>/<64 hex>.safetensors under latents/ and text/ are the cache's (dataset.py's names): a folder given
    by mistake (the user's own latents/<run>/*.safetensors) keeps its files, even with --delete --older-than 0."""
    _a, _b, cache, _old_a, _other = two_datasets
    ab = cache / "latents" / "ab"
    own = [cache / "latents" / "my_run" / "video_0001.safetensors", cache / "text" / "prompts" / "t5.safetensors",
           ab / "notes.safetensors", ab / ("cd" + "0" * 62 + ".safetensors")]
    for path in own:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"mine")
    _age(own, 40)
    n = len(entries(cache))
    assert n > 0 and not {e.path for e in entries(cache)} & set(own)
    assert cli.main(["cache", str(cache), "--older-than", "0", "--delete"]) == 0
    assert f"{n} entries" in capsys.readouterr().err
    assert entries(cache) == [] and all(path.exists() for path in own)


def test_bad_cache_command_inputs_name_the_input(tmp_path, capsys):
    assert cli.main(["cache", str(tmp_path / "nope")]) == 2
    assert f"cache folder '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err
    assert cli.main(["cache", str(tmp_path), "--older-than", "-1"]) == 2
    assert "--older-than -1: give a number of days, 0 or more" in capsys.readouterr().err


def test_a_cache_hit_is_read_from_the_header_and_a_damaged_entry_is_encoded_again(tmp_path):
    """cached_shapes parses the header itself (safe_open maps the file, and on a cold page cache its read-ahead read
    every entry whole: 40 MiB from storage for 20 entries of 2 MiB, 0.3 MiB now, /work/helpers/lead/shapes_cold.py),
    and checks what safetensors checks on load: an entry cut short, with a tensor's bytes not matching its shape, or
    with a gap, is a miss (encoded again), not a hit that fails at its first training read."""
    import json
    import torch
    from safetensors.torch import load_file, save_file
    good = tmp_path / "good.safetensors"
    save_file({"latent": torch.randn(4, 3, 2), "mask": torch.ones(1, 3, 2, dtype=torch.bfloat16)}, str(good))
    assert cache_files.cached_shapes(good, ("latent", "mask")) == {"latent": (4, 3, 2), "mask": (1, 3, 2)}
    data = good.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])

    def variant(name, payload: bytes):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(payload)
        return path
    bad_shape = dict(header, latent={**header["latent"], "shape": [4, 3, 3]})
    text = json.dumps(bad_shape).encode()
    gap = dict(header, latent={**header["latent"], "data_offsets": [header["latent"]["data_offsets"][0] + 4,
                                                                   header["latent"]["data_offsets"][1] + 4]})
    gap_text = json.dumps(gap).encode()
    damaged = {"truncated": data[:-1], "longer": data + b"\0", "garbage": b"\xff" * 16, "empty": b"",
               "bad_json": data[:8] + b"{" * n + data[8 + n:],
               "shape": len(text).to_bytes(8, "little") + text + data[8 + n:],
               "gap": len(gap_text).to_bytes(8, "little") + gap_text + data[8 + n:] + b"\0" * 4}
    for name, payload in damaged.items():
        path = variant(name, payload)
        assert cache_files.cached_shapes(path, ("latent",)) is None, name
        with pytest.raises(Exception):  # what a hit would have met at the training read
            load_file(str(path))
    assert cache_files.cached_shapes(good, ("latent", "context")) is None  # a name it lacks
    assert cache_files.cached_shapes(tmp_path / "missing.safetensors", ("latent",)) is None


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64", "complex64"])
def test_a_valid_entry_of_any_dtype_safetensors_writes_is_a_hit(tmp_path, dtype):
    """An encoder may return fp8 or unsigned latents or contexts: an entry of a dtype missing from cached_shapes'
    table was taken for damaged and encoded again at every load (a silent slowdown)."""
    import torch
    from safetensors.torch import load_file, save_file
    dt = getattr(torch, dtype)
    path = tmp_path / "entry.safetensors"
    save_file({"context": torch.ones(3, 5, dtype=dt), "pooled": torch.zeros(0, dtype=dt)}, str(path), {"a": "b"})
    load_file(str(path))  # valid for safetensors
    assert cache_files.cached_shapes(path, ("context", "pooled")) == {"context": (3, 5), "pooled": (0,)}
    data = path.read_bytes()
    path.write_bytes(data[:-1])  # and still checked
    assert cache_files.cached_shapes(path, ("context",)) is None
