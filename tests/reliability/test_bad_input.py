"""Bad input gets an error naming the input and the fix, through the node a user runs, and the process goes on;
docs/bad_input.md is checked against (TIGHTROPE_WRITE_DOCS=1: regenerated from) what these tests see."""
import os
import re
import shutil
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import bad_input_cases
import bad_input_run_cases
from bad_input_cases import Ctx, png
from bad_input_run_cases import CASES
from PIL import Image
from reliability_kit import assert_untouched, dataset_inputs, load_dataset, snapshot, train_node, world

from tightrope.cli import user_error_types
from tightrope.headless.comfyui_library import ComfyUIUnavailable
from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoImages
from tightrope.training.input_checks import OutputPathError
from tightrope.training.lora.targets import LoraError
from tightrope.training.state.lock import StateLockedError

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad_input.md"
SEEN: dict[str, str] = {}  # case id -> "ErrorType: message" as the user sees it, paths made generic
# the error types the cases name (Case.error), by name: the user errors `tightrope run` prints without a traceback,
# subclasses of them, and two that are not (a '..' filename prefix, a state file in use)
ERROR_TYPES = {t.__name__: t for t in (*user_error_types(), ComfyUIUnavailable, LoraError, OutputPathError,
                                       StateLockedError, ValueError)}


def _see(case, out: Path, tmp: Path) -> str:
    with host.headless(out), pytest.raises(ERROR_TYPES[case.error]) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case.run(Ctx(out, tmp))
    text = f"{type(caught.value).__name__}: {caught.value}".replace(str(out), "<output>").replace(str(tmp), "<tmp>")
    SEEN[case.id] = re.sub(r" at 0x[0-9a-f]+", "", text)
    return SEEN[case.id]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_names_the_input_and_the_fix(case, tmp_path):
    seen = _see(case, tmp_path / "out", tmp_path)
    assert seen.startswith(case.error + ": "), seen
    for word in case.words:
        assert word in seen, (word, seen)
    outside = [*tmp_path.glob("escape*"), *Path("/tmp").glob("escape*"), *tmp_path.glob("x_*")]
    assert not outside  # nothing was written outside the output folder


def test_the_process_goes_on_after_errors(out, monkeypatch):
    model, dataset, spec, strat = shared = world(out)
    before = snapshot(model.flux)
    for cases in (bad_input_cases, bad_input_run_cases):
        monkeypatch.setattr(cases, "world", lambda _out: shared)  # every failing run gets this same model
    for case in [c for c in CASES if c.node.startswith("Train LoRA")]:
        shutil.rmtree(out / ".tightrope_state", ignore_errors=True)  # each case a run of its own: no state left
        with pytest.raises(ERROR_TYPES[case.error]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case.run(Ctx(out, out.parent))
    session, _, _ = train_node(model, dataset, spec, strat, steps=2, filename_prefix="rt/after")
    assert session.step == 2 and all(torch.isfinite(torch.tensor(session.losses)))
    assert_untouched(model.flux, before)


CONVERTED = {  # these are not errors: converted to 8-bit RGB (alpha composited onto white)
    "rgba": lambda: Image.new("RGBA", (32, 32), (10, 200, 10, 128)),
    "grey": lambda: Image.new("L", (32, 32), 77),
    "palette": lambda: Image.new("P", (32, 32), 3),
    "grey_16bit": lambda: Image.frombytes("I;16", (32, 32), (b"\xff\x7f" * 32 * 32)),
    "cmyk_jpeg": lambda: Image.new("CMYK", (32, 32), (0, 255, 255, 0)),
}


def test_non_rgb_and_16_bit_images_work(out):
    folder = out.parent / "modes"
    folder.mkdir()
    for name, make in CONVERTED.items():
        image = make()
        ext = ".jpg" if image.mode == "CMYK" else ".png"
        image.save(folder / f"{name}{ext}")
        (folder / f"{name}.txt").write_text(f"a {name} image")
    dataset = TightropeLoadDataset().load(**dataset_inputs(folder, strict=True))[0]
    assert dataset.num_images == len(CONVERTED)
    assert all(torch.isfinite(dataset.latent(i)).all() for i in range(dataset.num_images))
    grey16 = Image.open(folder / "grey_16bit.png")
    assert grey16.mode.startswith("I")  # really 16-bit on disk


def test_a_bad_image_in_a_dataset_is_skipped_with_a_warning_naming_it(out):
    (folder,) = TightropeDemoImages().make("imgs", 6, 32, 0)
    Path(folder, "003.png").write_bytes(png(Image.new("RGB", (32, 32)))[:50])  # truncated
    with pytest.warns(UserWarning, match=r"skipping an image \(strict=False\): cannot read image '.*003\.png'"):
        dataset = load_dataset(folder)
    assert dataset.num_images == 5
    with pytest.raises(ValueError, match=r"003\.png"):
        load_dataset(folder, strict=True)


def _table() -> str:
    rows = ["| bad input | node | what you see |", "| --- | --- | --- |"]
    for case in CASES:
        seen = SEEN[case.id].replace("|", "\\|")
        rows.append(f"| {case.input} | {case.node} | {seen} |")
    return "\n".join(rows) + "\n"


def test_docs_bad_input_md_matches_the_tests(tmp_path):
    for i, case in enumerate(CASES):
        if case.id not in SEEN:  # this test run alone
            (tmp_path / str(i)).mkdir()
            _see(case, tmp_path / str(i) / "out", tmp_path / str(i))
    table = _table()
    text = DOC.read_text() if DOC.exists() else ""
    start, end = "<!-- table: generated by tests/reliability/test_bad_input.py -->", "<!-- end of table -->"
    if os.environ.get("TIGHTROPE_WRITE_DOCS"):
        head, _, rest = text.partition(start)
        DOC.write_text(f"{head}{start}\n{table}{end}{rest.partition(end)[2]}")
        text = DOC.read_text()
    assert start in text, f"{DOC} lacks its table: run TIGHTROPE_WRITE_DOCS=1 pytest {__file__}"
    assert text.split(start)[1].split(end)[0].strip() == table.strip(), \
        f"{DOC} is out of date: run TIGHTROPE_WRITE_DOCS=1 pytest {__file__}"


# --- failfast: a bad value in the last nodes of a chain stops `tightrope run` before the first training step ---
def _run_chain_cli(tmp_path, monkeypatch, capsys, **changes) -> tuple[int, str, list]:
    """`tightrope run` (in process) on the tiny two-Train-then-Save chain; returns (exit code, stderr, the training
    calls made)."""
    import json

    from bad_input_run_cases import chain_prompt

    from tightrope import cli
    from tightrope.training import training_run
    trained = []
    real_train = training_run.train
    monkeypatch.setattr(training_run, "train", lambda *a, **k: trained.append(a) or real_train(*a, **k))
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(chain_prompt(**changes)))
    code = cli.main(["run", str(path), "--output-dir", str(tmp_path / "out")])
    return code, capsys.readouterr().err, trained


def test_the_good_chain_trains_and_saves(tmp_path, monkeypatch, capsys):
    code, err, trained = _run_chain_cli(tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert len(trained) == 2 and list((tmp_path / "out" / "rt").glob("final_*.safetensors"))


@pytest.mark.parametrize("changes, words", [
    ({"save": {"filename_prefix": "../x"}}, ("node 9 'TightropeSaveLora'", "'../x'", "only go down")),
    ({"save": {"filename_prefix": "lora:v2"}}, ("node 9 'TightropeSaveLora'", "':'", "use letters, digits")),
    ({"train2": {"learning_rate": float("nan")}}, ("node 8 'TightropeTrain'", "input 'learning_rate' is nan",
                                                   "use a value in 1e-07..1.0")),
    ({"strategy_node": {"weight_dtype": "fp16"}}, ("node 6 'TightropeMemoryStrategy'", "weight_dtype='fp16'",
                                                   "set compute_dtype='fp16'")),
    ({"train2": {"timestep_min": 0.9, "timestep_max": 0.875}}, ("node 8 'TightropeTrain'",
                                                                "timestep_max=0.875 is not above timestep_min=0.9")),
], ids=["save_dotdot", "save_colon", "train2_lr_nan", "weight_fp16_compute_fp32", "train2_empty_timestep_range"])
def test_a_bad_value_late_in_a_chain_fails_before_any_training(tmp_path, monkeypatch, capsys, changes, words):
    code, err, trained = _run_chain_cli(tmp_path, monkeypatch, capsys, **changes)
    assert code == 2 and not trained, err  # 2: a workflow problem, found before any node ran
    assert not (tmp_path / "out" / "imgs").exists()  # not even the demo images were drawn
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def test_an_unwritable_loras_folder_fails_before_any_training(tmp_path, monkeypatch, capsys):
    """os.access says the output dir is read-only (as chmod would for a user other than root)."""
    from tightrope.training import input_checks
    out_dir, real_access = tmp_path / "out", os.access
    monkeypatch.setattr(input_checks.os, "access", lambda p, mode, **kw: Path(p) != out_dir and real_access(p, mode))
    code, err, trained = _run_chain_cli(tmp_path, monkeypatch, capsys)
    assert code == 2 and not trained, err
    assert f"needs to write into '{out_dir}', which this user may not write to: make it writable" in err


def test_a_read_only_output_dir_fails_before_any_training(tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out_dir.chmod(0o555)
    try:
        if os.access(out_dir, os.W_OK):
            print("running as root: chmod 0555 does not stop root from writing; the os.access test above covers it")
            pytest.skip("chmod does not make a folder read-only for root")
        code, err, trained = _run_chain_cli(tmp_path, monkeypatch, capsys)
    finally:
        out_dir.chmod(0o755)
    assert code == 2 and not trained, err
    assert "which this user may not write to" in err


def test_tiny_images_upscaled_a_lot_are_named_in_a_warning(out):
    folder = out.parent / "tiny"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (1, 1), (i * 60, 0, 0)).save(folder / f"dot{i}.png")
        (folder / f"dot{i}.txt").write_text("a dot")
    Image.new("RGB", (32, 32)).save(folder / "fine.png")
    (folder / "fine.txt").write_text("a square")
    from tightrope.demo.encoders import DemoLatentCodec
    encoded, real_encode = [], DemoLatentCodec.encode
    warned_before = []

    def encode(self, images):  # said before the first image is encoded (from the headers): a 4096 resolution on
        warned_before.append(len(encoded) == 0 and any("upscaled" in str(w.message) for w in caught))  # small
        encoded.append(1)  # images made latents so large the encoding ran for minutes before (found by a helper)
        return real_encode(self, images)
    with pytest.warns(UserWarning, match=r"4 image\(s\) are smaller than the training resolution and are upscaled "
                                         r"more than 2x.*dot0\.png' 32\.0x.*dot3\.png' 32\.0x: use larger images, "
                                         r"or lower the Load Dataset resolution") as caught, \
            mock.patch.object(DemoLatentCodec, "encode", encode):
        load_dataset(folder)  # resolution 32: each 1x1 dot becomes a 32x32 bucket
    assert not [w for w in caught if "fine.png" in str(w.message)]
    assert warned_before[0], "the upscale warning came after the encoding"


def test_animated_images_are_named_in_a_warning_and_train_on_their_first_frame(out):
    """An animated PNG or WebP trains on its first frame: said once, naming them, before the encoding (it was
    silent); a camera's MPO JPEG (the photo, then a preview) and a still image are not named."""
    folder = out.parent / "animated"
    folder.mkdir()
    red, blue = Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))
    for ext in ("png", "webp"):  # GIF is refused by its extension
        red.save(folder / f"moving.{ext}", save_all=True, append_images=[blue], duration=100, loop=0)
    red.save(folder / "camera.jpg", format="MPO", save_all=True, append_images=[blue])
    red.save(folder / "still.png")
    for image in folder.iterdir():
        image.with_suffix(".txt").write_text("a red square")
    with Image.open(folder / "camera.jpg") as mpo:
        assert mpo.format == "MPO" and mpo.is_animated  # what the warning must not count
    with pytest.warns(UserWarning, match=r"2 image\(s\) are animated and train on their first frame only: "
                                         r"'[^']*moving\.png', '[^']*moving\.webp': export "
                                         r"the frames you want as separate images") as caught:
        dataset = load_dataset(folder)
    assert not [w for w in caught if "camera.jpg" in str(w.message) or "still.png" in str(w.message)]
    assert dataset.num_images == 4


def test_use_repeats_off_reads_no_repeat_count_from_folder_names(out):
    """use_repeats=False: '0_misc' and a date-named folder are plain folders, each image once (found by a helper: a
    '0_misc' folder was refused, or with strict off its images dropped, although repeats were off)."""
    folder = out.parent / "named"
    for k, sub in enumerate(("0_misc", "20240615_beach", "3_char")):
        (folder / sub).mkdir(parents=True)
        Image.new("RGB", (32, 32), (60 * k, 0, 0)).save(folder / sub / "a.png")  # three images, not one saved twice
        (folder / sub / "a.txt").write_text(f"a {sub}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no image skipped, no warning about large counts
        dataset = load_dataset(folder, use_repeats=False, strict=True)
    assert dataset.num_images == 3 and len(dataset) == 3


# --- workflow files and literals that used to end in a traceback or be found only when a node ran (a helper's
# input fuzzing) ---
def _run_prompt_cli(tmp_path, monkeypatch, capsys, prompt, name="wf.json") -> tuple[int, str, list]:
    """`tightrope run` (in process) on `prompt` (a dict, or the file's bytes); (exit code, stderr, training calls)."""
    import json

    from tightrope import cli
    from tightrope.training import training_run
    trained = []
    real_train = training_run.train
    monkeypatch.setattr(training_run, "train", lambda *a, **k: trained.append(a) or real_train(*a, **k))
    path = tmp_path / name
    path.write_bytes(prompt if isinstance(prompt, bytes) else json.dumps(prompt).encode())
    code = cli.main(["run", str(path), "--output-dir", str(tmp_path / "out")])
    return code, capsys.readouterr().err, trained


def test_a_workflow_file_with_a_utf8_byte_order_mark_runs(tmp_path, monkeypatch, capsys):
    """Windows Notepad saves UTF-8 with a BOM; ComfyUI's frontend loads such a file, so does `tightrope run`."""
    import json

    from bad_input_run_cases import chain_prompt
    code, err, trained = _run_prompt_cli(tmp_path, monkeypatch, capsys,
                                         b"\xef\xbb\xbf" + json.dumps(chain_prompt()).encode())
    assert code == 0 and len(trained) == 2, err


@pytest.mark.parametrize("data, words", [
    (b"[" * 100_000 + b"]" * 100_000, ("is not a workflow", "nested too deeply", "save the workflow again")),
    (b'{"1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}, "_meta": {"title": "caf\xe9"}}}',
     ("is not UTF-8 text (bad byte at offset 89)", "re-save it with UTF-8")),
], ids=["nested_too_deeply", "latin1_text"])
def test_an_unreadable_workflow_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys, data, words):
    code, err, trained = _run_prompt_cli(tmp_path, monkeypatch, capsys, data)
    assert code == 2 and not trained and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


def test_a_train_node_without_model_dataset_or_lora_fails_before_any_node_runs(tmp_path, monkeypatch, capsys):
    """Known from the graph: refused before the model loads and the dataset is encoded, not when the node runs."""
    from bad_input_run_cases import chain_prompt
    prompt = chain_prompt()
    del prompt["7"]["inputs"]["dataset"], prompt["7"]["inputs"]["lora"]
    code, err, trained = _run_prompt_cli(tmp_path, monkeypatch, capsys, prompt)
    assert code == 2 and not trained, err
    assert not (tmp_path / "out" / "imgs").exists()  # not even the demo images were drawn
    assert ("node 7 'TightropeTrain' failed its own input check: the Train node has no dataset, lora input: connect "
            "model, dataset and lora (to start) or a session") in err


def test_a_train_node_feeding_no_output_is_not_checked(tmp_path, monkeypatch, capsys):
    """As in ComfyUI, a node that feeds no output node neither runs nor is checked (a half-built side branch)."""
    from bad_input_run_cases import chain_prompt
    prompt = chain_prompt()
    prompt["20"] = {"class_type": "TightropeTrain", "inputs": {**prompt["8"]["inputs"]}}
    del prompt["20"]["inputs"]["session"]
    code, err, trained = _run_prompt_cli(tmp_path, monkeypatch, capsys, prompt)
    assert code == 0 and len(trained) == 2, err


@pytest.mark.parametrize("node, name", [("8", "device"), ("6", "mode"), ("5", "targets")])
def test_a_null_choice_is_refused_before_any_node_runs(tmp_path, monkeypatch, capsys, node, name):
    """JSON null for a COMBO: the node's own check takes None for a linked input, so it reached the node (device:
    an AttributeError traceback; Memory Strategy mode: trained as 'manual' without a word)."""
    from bad_input_run_cases import chain_prompt
    prompt = chain_prompt()
    prompt[node]["inputs"][name] = None
    code, err, trained = _run_prompt_cli(tmp_path, monkeypatch, capsys, prompt)
    assert code == 2 and not trained and "Traceback" not in err, err
    assert f"input '{name}' is null, not one of its choices: " in err


def test_a_null_choice_that_reaches_a_node_is_refused_there():
    """In ComfyUI a null COMBO passes the queue-time check (our VALIDATE_INPUTS takes **inputs, so ComfyUI skips its
    list check, and None is what a linked input looks like): the node refuses it when it runs, naming the input."""
    from tightrope.memory.strategy import StrategyError
    from tightrope.nodes.strategy_node import TightropeMemoryStrategy
    from tightrope.training.distributed import resolve_device
    from tightrope.training.train_config import ConfigError
    with pytest.raises(ConfigError, match=r"^device=None is not a device: choose 'auto', 'cuda' or 'cpu'$"):
        resolve_device(None)
    with pytest.raises(StrategyError, match=r"^input 'mode' is None: choose 'manual' or 'auto'$"):
        TightropeMemoryStrategy().make(None, 0.0)
