"""The nodes through their own entry points, as ComfyUI and the headless runner call them."""
import pytest
import torch

from tightrope import NODE_CLASS_MAPPINGS
from tightrope.memory.strategy import StrategyError
from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeDatasetFromLatents, TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoEncoders, TightropeDemoImages, TightropeDemoModel
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.nodes.strategy_node import TightropeMemoryStrategy
from tightrope.nodes.train_node import TightropeTrain
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.lora.layers import INITS
from tightrope.training.lora.targets import PRESETS
from tightrope.training.train_config import ConfigError


@pytest.fixture
def out(tmp_path):
    with host.headless(tmp_path):
        yield tmp_path


def _dataset_inputs(out):
    (folder,) = TightropeDemoImages().make("imgs", 4, 32, 0)
    vae, clip = TightropeDemoEncoders().load(0)
    return dict(folder=folder, vae=vae, clip=clip, resolution=32, caption_dropout=0.0, use_repeats=True,
                strict=False)


def test_second_dataset_load_reuses_the_cache(out):
    inputs = _dataset_inputs(out)
    (first,) = TightropeLoadDataset().load(**inputs)
    (second,) = TightropeLoadDataset().load(**inputs)
    assert first.encoded_images == 4 and second.encoded_images == 0 and second.image_cache_hits == 4
    torch.testing.assert_close(first.latent(0), second.latent(0))


def test_a_dataset_load_says_where_its_cache_is_and_what_it_did_not_use(out, monkeypatch):
    said = []
    monkeypatch.setattr(host, "notify", said.append)
    inputs = _dataset_inputs(out)
    (first,) = TightropeLoadDataset().load(**{**inputs, "resolution": 16})
    (second,) = TightropeLoadDataset().load(**inputs)  # another resolution: the first load's latents go unused
    cache = out / ".tightrope_cache"
    assert said[0].startswith(f"dataset cache '{cache}': ") and "4 used by this load" not in said[0]
    n_used, n_all = len(second.cache_files()), len(first.cache_files() | second.cache_files())
    assert f"in {n_all} entries, {n_used} used by this load; 4 others (" in said[1] and len(said) == 2
    assert "are other datasets' or from earlier settings" in said[1] and "--older-than" not in said[1]  # all new


def test_a_kept_dataset_whose_cache_entries_were_removed_is_loaded_again(out):
    """ComfyUI keeps a Load Dataset node's output while IS_CHANGED says the same, and the dataset reads its cache
    entries at each training read: after `tightrope cache --older-than D --delete` removed them (a server idle for D
    days), the next training of the kept dataset failed at its first read (FileNotFoundError). IS_CHANGED now changes
    (and stays so: loaded again once), and a read of a removed entry says what happened (a review helper)."""
    import os
    import time

    from tightrope.training.data.cache_files import entries, prune
    inputs = _dataset_inputs(out)
    (dataset,) = TightropeLoadDataset().load(**inputs)
    folder = inputs["folder"]
    kept = TightropeLoadDataset.IS_CHANGED(folder=folder)
    linked = TightropeLoadDataset.IS_CHANGED(folder=None)  # a folder linked from another node: ComfyUI gives None
    assert TightropeLoadDataset.IS_CHANGED(folder=folder) == kept  # nothing changed: ComfyUI reuses the dataset
    cache = host.cache_dir()
    then = time.time() - 40 * 86400
    for e in entries(cache):
        os.utime(e.path, (then, then))
    assert len(prune(cache, 30, delete=True)) == len(dataset.cache_files())
    removed = TightropeLoadDataset.IS_CHANGED(folder=folder)
    assert removed != kept and TightropeLoadDataset.IS_CHANGED(folder=folder) == removed
    assert TightropeLoadDataset.IS_CHANGED(folder=None) != linked
    with pytest.raises(DatasetError, match="was removed after this dataset was loaded .* load the dataset again"):
        dataset.latent(0)
    (again,) = TightropeLoadDataset().load(**inputs)
    assert again.encoded_images == 4 and tuple(again.latent(0).shape) == dataset.latent_shape(0)


def test_dataset_errors_name_the_folder(out):
    inputs = _dataset_inputs(out)
    with pytest.raises(ValueError, match="does not exist"):
        TightropeLoadDataset().load(**{**inputs, "folder": str(out / "nope")})
    (out / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        TightropeLoadDataset().load(**{**inputs, "folder": str(out / "empty")})


def test_dataset_from_comfy_latents_and_conditioning():
    latent = {"samples": torch.randn(3, 16, 8, 8)}
    conditioning = [[torch.randn(1, 5, 64), {"pooled_output": torch.randn(1, 32)}]]
    (dataset,) = TightropeDatasetFromLatents().load(latent, conditioning, 0.0)
    assert len(dataset) == 3 and dataset.latent(2).shape == (16, 8, 8)


def test_dataset_from_latents_bad_inputs_are_dataset_errors_naming_the_input():
    """DatasetError is one of `tightrope run`'s user errors: one line, no traceback (a ValueError was a bug's)."""
    cond = [[torch.randn(1, 5, 64), {"pooled_output": torch.randn(1, 32)}]]
    with pytest.raises(DatasetError, match=r"conditioning has 2 entries for 3 latents: give one conditioning"):
        TightropeDatasetFromLatents().load({"samples": torch.randn(3, 16, 8, 8)}, cond * 2, 0.0)
    with pytest.raises(DatasetError, match=r"latent: samples have shape \(3, 16, 4\); expected images"):
        TightropeDatasetFromLatents().load({"samples": torch.randn(3, 16, 4)}, cond, 0.0)
    (clips,) = TightropeDatasetFromLatents().load({"samples": torch.randn(3, 16, 4, 8, 8)}, cond, 0.0)
    assert clips.latent_shape(2) == (16, 4, 8, 8)  # a video VAE's clips: one sample each, with their frames
    with pytest.raises(DatasetError, match=r"latent: expected ComfyUI's LATENT"):
        TightropeDatasetFromLatents().load(torch.randn(3, 16, 8, 8), cond, 0.0)
    (dataset,) = TightropeDatasetFromLatents().load({"samples": torch.randn(2, 16, 1, 8, 8)}, cond * 2, 0.0)
    assert len(dataset) == 2 and dataset.latent(1).shape == (16, 8, 8)  # single-frame video latents are images
    # caption dropout without the empty caption names the node's input (it named from_tensors' Python arguments)
    with pytest.raises(DatasetError, match=r"caption_dropout=0.1 trains some samples with the empty caption: connect "
                                           r"empty_conditioning \(a CLIP Text Encode of an empty prompt\)"):
        TightropeDatasetFromLatents().load({"samples": torch.randn(3, 16, 8, 8)}, cond, 0.1)


def test_lora_setup_errors_name_the_input():
    with pytest.raises(ValueError, match="rank"):
        TightropeLoraSetup().setup(0, 1.0, False, 0.0, "attention", "default")
    with pytest.raises(ValueError, match="alpha"):
        TightropeLoraSetup().setup(4, 0.0, False, 0.0, "attention", "default")
    with pytest.raises(ValueError, match="safetensors"):
        TightropeLoraSetup().setup(4, 4.0, False, 0.0, "attention", "default", existing_lora="/tmp/x.ckpt")


def test_lora_setup_offers_the_lora_modules_presets_and_inits():
    spec = TightropeLoraSetup.INPUT_TYPES()["required"]
    assert spec["targets"][0] == list(PRESETS) == ["attention", "attention_mlp", "all_linear"]  # saved values stay
    assert spec["init"][0] == list(INITS) == ["default", "gaussian"]
    for targets in spec["targets"][0]:
        for init in spec["init"][0]:
            (lora,) = TightropeLoraSetup().setup(4, 4.0, False, 0.0, targets, init)
            assert (lora.targets, lora.init) == (targets, init)


def _strategy_inputs(**kw):
    spec = TightropeMemoryStrategy.INPUT_TYPES()["required"]
    values = {k: (v[1]["default"]) for k, v in spec.items()}
    values.update(kw)
    return values


def test_strategy_node_validates():
    (s,) = TightropeMemoryStrategy().make(**_strategy_inputs(offload_fraction=0.5, checkpoint="all"))
    assert s.offload.fraction == 0.5 and s.checkpointing.mode == "all"
    with pytest.raises(StrategyError, match="offload_fraction=1.5"):
        TightropeMemoryStrategy().make(**_strategy_inputs(offload_fraction=1.5))
    (offloaded,) = TightropeMemoryStrategy().make(**_strategy_inputs(optimizer_offload=True))
    assert offloaded.optimizer.enabled and not s.optimizer.enabled  # optional: left out, off
    assert TightropeMemoryStrategy.VALIDATE_INPUTS(**_strategy_inputs(optimizer_offload=True)) is True


def _train_widgets(**kw):
    spec = TightropeTrain.INPUT_TYPES()["required"]
    values = {k: v[1]["default"] for k, v in spec.items()}
    values.update(dict(steps=2, batch_size=2, device="cpu"), **kw)
    return values


def test_train_node_needs_model_dataset_lora(out):
    with pytest.raises(ConfigError, match="no model, dataset, lora input"):
        TightropeTrain().train(**_train_widgets())


def test_train_node_chains_without_changing_its_inputs(out):
    (model,) = TightropeDemoModel().load(0)
    (dataset,) = TightropeLoadDataset().load(**_dataset_inputs(out))
    (lora,) = TightropeLoraSetup().setup(4, 4.0, False, 0.0, "attention", "default")
    (strategy,) = TightropeMemoryStrategy().make(**_strategy_inputs(compute_dtype="fp32"))
    with torch.inference_mode():  # as ComfyUI calls nodes
        session, model_out, report = TightropeTrain().train(**_train_widgets(), model=model, dataset=dataset,
                                                            lora=lora, strategy=strategy)
        more, _, _ = TightropeTrain().train(**_train_widgets(steps=1), session=session)
    assert session.step == 2 and more.step == 3 and more.losses[:2] == session.losses
    assert model_out is not model and "step 2" in report
    with pytest.raises(ConfigError, match="different model"):
        TightropeTrain().train(**_train_widgets(), session=session, model=TightropeDemoModel().load(1)[0])


def test_auto_strategy_plans_within_the_budget_and_trains(out):
    (model,) = TightropeDemoModel().load(0)
    (dataset,) = TightropeLoadDataset().load(**_dataset_inputs(out))
    (lora,) = TightropeLoraSetup().setup(4, 4.0, False, 0.0, "attention", "default")
    (auto,) = TightropeMemoryStrategy().make(**_strategy_inputs(mode="auto", vram_budget_gb=0.02,
                                                                compute_dtype="fp32"))
    session, _, report = TightropeTrain().train(**_train_widgets(steps=1), model=model, dataset=dataset, lora=lora,
                                                strategy=auto)
    assert session.step == 1 and session.strategy != auto
    assert "GB" in report or "MiB" in report or "GiB" in report  # the planner's explanation is in the report
    with pytest.raises(StrategyError, match="vram_budget_gb=0 plans for the free GPU memory.*set vram_budget_gb"):
        TightropeTrain().train(**_train_widgets(steps=1), model=model, dataset=dataset, lora=lora,
                               strategy=TightropeMemoryStrategy().make(**_strategy_inputs(mode="auto"))[0])


def test_seed_inputs_stay_fixed_after_each_queue():
    """The frontend adds a 'control after generate' widget to every INT input named seed, set to randomize unless
    the input says otherwise: a new Train node drew a new seed at every queue (retraining from scratch when only the
    Save prefix changed), and the demo nodes a new model and new images."""
    seeds = [(name, key) for name, cls in NODE_CLASS_MAPPINGS.items()
             for section in cls.INPUT_TYPES().values() for key, spec in section.items()
             if key in ("seed", "noise_seed") and spec[0] == "INT"]
    assert ("TightropeTrain", "seed") in seeds and len(seeds) >= 5
    for name, key in seeds:
        spec = next(s[key] for s in NODE_CLASS_MAPPINGS[name].INPUT_TYPES().values() if key in s)
        assert spec[1].get("control_after_generate") == "fixed", (name, key)


def test_a_dataset_folder_changed_since_the_last_run_is_loaded_again(tmp_path):
    """ComfyUI reuses a node's cached output while its inputs and IS_CHANGED stay the same: images added to the folder
    (or a caption edited) after a run were ignored, and Train then refused a batch larger than the old dataset."""
    import os

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"png")
    (folder / "a.txt").write_text("a cat")
    first = TightropeLoadDataset.IS_CHANGED(folder=str(folder), resolution=512)
    assert TightropeLoadDataset.IS_CHANGED(folder=str(folder), resolution=512) == first  # nothing changed: cached
    (folder / ".hidden").write_text("editor state")
    assert TightropeLoadDataset.IS_CHANGED(folder=str(folder)) == first  # hidden names are not data
    (folder / "sub").mkdir()
    (folder / "sub" / "b.png").write_bytes(b"png")
    added = TightropeLoadDataset.IS_CHANGED(folder=str(folder))
    assert added != first
    (folder / "a.txt").write_text("a black cat")  # same name, new caption
    edited = TightropeLoadDataset.IS_CHANGED(folder=str(folder))
    assert edited != added
    os.utime(folder / "a.txt", ns=(1, 1))  # same size, only the modification time differs
    assert TightropeLoadDataset.IS_CHANGED(folder=str(folder)) != edited
    assert TightropeLoadDataset.IS_CHANGED(folder=str(tmp_path / "missing")) not in (first, added, edited)


def test_a_lora_to_continue_from_saved_again_under_its_name_counts_as_changed(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    monkeypatch.setattr(host, "loras_dir", lambda: str(tmp_path))
    path = tmp_path / "mine.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    first = TightropeLoraSetup.IS_CHANGED(existing_lora="mine.safetensors", rank=4)
    assert first == TightropeLoraSetup.IS_CHANGED(existing_lora="mine.safetensors", rank=4)
    save_file({"x": torch.zeros(3)}, str(path))
    assert TightropeLoraSetup.IS_CHANGED(existing_lora="mine.safetensors") != first
    assert TightropeLoraSetup.IS_CHANGED(existing_lora="") == ""
    assert TightropeLoraSetup.IS_CHANGED(existing_lora="gone.safetensors") == "missing"


def test_load_dataset_video_inputs_come_after_the_old_ones():
    """Saved workflows list widget values in input order: frames and fps are appended, optional, with defaults."""
    optional = TightropeLoadDataset.INPUT_TYPES()["optional"]
    assert list(optional) == ["mask", "frames", "fps"]
    assert optional["frames"][1]["default"] == 33 and optional["fps"][1]["default"] == 16.0
    import inspect
    params = inspect.signature(TightropeLoadDataset.load).parameters
    assert params["frames"].default == 33 and params["fps"].default == 16.0
