"""ComfyUI's Train node `resume` widget: queue the workflow again after an interrupt and the node goes on from its
last completed step to the uninterrupted run's LoRA, bit for bit; from nothing but the very same run (another input,
setting, step count, model or a damaged file: it trains anew and says why); a finished node returns its result
untrained; the widget off always trains anew."""
import shutil
from pathlib import Path

import pytest
import torch
from reliability_kit import load_dataset, lora, strategy, train_node, world

from tightrope.nodes import host
from tightrope.nodes.demo_nodes import TightropeDemoImages, TightropeDemoModel
from tightrope.training import trainer
from tightrope.training.state.resume import load_state, state_path

KW = dict(steps=6, save_every=2, schedule="cosine")


@pytest.fixture
def comfy(out, monkeypatch):
    """The node as inside ComfyUI (host.resume_mode's ComfyUI branch, tested in tests/headless/test_cli.py), its
    notes and progress recorded; `stop_at` interrupts after that step."""
    monkeypatch.setattr(host, "resume_mode", lambda widget=True: "same run" if widget else "off")
    rec = {"notes": [], "calls": [], "stop_at": None}
    monkeypatch.setattr(host, "notify", rec["notes"].append)
    monkeypatch.setattr(host, "progress_reporter", lambda total: lambda d, t, loss: rec["calls"].append(d))
    monkeypatch.setattr(host, "interrupt_requested",
                        lambda: rec["stop_at"] is not None and len(rec["calls"]) >= rec["stop_at"])
    return rec


def _interrupted(rec, *inputs, at=3, **kw):
    rec["calls"].clear()
    rec["stop_at"] = at
    with pytest.raises(KeyboardInterrupt):  # ComfyUI ends the prompt as interrupted
        train_node(*inputs, **KW | kw)
    rec["stop_at"] = None
    rec["calls"].clear()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())


def test_queued_again_after_an_interrupt_the_node_goes_on_to_the_uninterrupted_lora(out, comfy):
    inputs = world(out)
    with torch.inference_mode():  # as ComfyUI calls nodes
        whole, _, _ = train_node(*inputs, **KW, filename_prefix="rt/whole")
        _interrupted(comfy, *inputs)
        resumed, _, report = train_node(*inputs, **KW)
    assert any(n.endswith("; queue the workflow again to go on from there") for n in comfy["notes"])
    assert comfy["calls"] == [4, 5, 6]  # only the steps the node had left
    assert "goes on from step 3 of its run (steps 0-6)" in comfy["notes"][-1]
    assert resumed.step == 6 and resumed.losses == whole.losses and "step 6" in report
    assert _same(resumed.lora_state, whole.lora_state)
    for k, v in whole.optimizer_state["state"].items():
        assert all(torch.equal(resumed.optimizer_state["state"][k][n], t) for n, t in v.items())


def test_a_memory_setting_that_moves_the_same_values_goes_on_to_the_uninterrupted_lora(out, comfy):
    """Interrupted, then queued with layer offload, activation offload and checkpointing changed (what a user does
    after running out of memory): these move or recompute the same values, so the run goes on, bit for bit."""
    model, dataset, spec, strat = world(out)
    whole, _, _ = train_node(model, dataset, spec, strat, **KW, filename_prefix="rt/whole")
    _interrupted(comfy, model, dataset, spec, strat)
    leaner = strategy(offload_fraction=1.0, checkpoint="all", activation_offload=True)
    resumed, _, _ = train_node(model, dataset, spec, leaner, **KW)
    assert comfy["calls"] == [4, 5, 6] and resumed.losses == whole.losses and _same(resumed.lora_state, whole.lora_state)


def test_a_finished_node_queued_again_returns_its_result_untrained(out, comfy, monkeypatch):
    """After a server restart ComfyUI runs every node again: a finished Train node must not train again."""
    inputs = world(out)
    first, _, _ = train_node(*inputs, **KW)
    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("a finished node trained again"))
    again, _, _ = train_node(*inputs, **KW)
    assert again.step == 6 and again.losses == first.losses and _same(again.lora_state, first.lora_state)
    assert "had finished" in comfy["notes"][-1]


@pytest.mark.parametrize("change, named", [
    (dict(learning_rate=2e-3), "learning_rate: 0.001 -> 0.002"),
    (dict(steps=8), "steps: 6 -> 8"),  # the cosine schedule spans the run: 3 more steps would not give 8 steps' LoRA
    (dict(seed=1), "seed: 0 -> 1"),
    (dict(timestep_min=0.875), "timestep_min: 0.0 -> 0.875"),  # Wan 2.2's high-noise expert's range
    (dict(timestep_max=0.875), "timestep_max: 1.0 -> 0.875"),
])
def test_another_setting_trains_anew_and_says_which(out, comfy, change, named):
    inputs = world(out)
    _interrupted(comfy, *inputs)
    fresh, _, _ = train_node(*inputs, **KW | change, filename_prefix="rt/fresh")
    again, _, _ = train_node(*inputs, **KW | change)
    assert comfy["calls"][-again.step:] == list(range(1, again.step + 1))  # from step 1
    assert any("trains from its input, not from its saved state" in n and named in n for n in comfy["notes"])
    assert again.losses == fresh.losses and _same(again.lora_state, fresh.lora_state)
    assert load_state(state_path(host.state_dir(), "rt/lora", None)).step == again.step  # the file is replaced


def test_another_model_or_lora_trains_anew(out, comfy):
    model, dataset, spec, strat = world(out)
    _interrupted(comfy, model, dataset, spec, strat)
    other = TightropeDemoModel().load(1)[0]
    again, _, _ = train_node(other, dataset, spec, strat, **KW)
    assert again.step == 6 and "another model (same architecture, different base weights)" in comfy["notes"][-1]
    _interrupted(comfy, model, dataset, spec, strat)
    again, _, _ = train_node(model, dataset, lora(rank=8, alpha=4.0), strat, **KW)
    assert again.step == 6 and "LoRA rank: 4 -> 8" in comfy["notes"][-1]  # refused headless; here a new run


def test_a_damaged_state_file_trains_anew(out, comfy):
    inputs = world(out)
    _interrupted(comfy, *inputs)
    path = state_path(host.state_dir(), "rt/lora", None)
    path.write_bytes(path.read_bytes()[:300])
    again, _, _ = train_node(*inputs, **KW)
    assert again.step == 6 and "could not be read" in comfy["notes"][-1]
    assert load_state(path).step == 6


def test_the_widget_off_always_trains_anew(out, comfy):
    inputs = world(out)
    _interrupted(comfy, *inputs)
    again, _, _ = train_node(*inputs, **KW, resume=False)
    assert comfy["calls"][:1] == [1] and again.step == 6
    assert not any("goes on from step" in n for n in comfy["notes"])


# -- changes the settings do not show: what feeds the node changed, not its widgets (found in a real ComfyUI server:
# each of these resumed, or returned the finished result, from the other inputs' run) --------------------------
def _trained_lora(out, seed):
    model, dataset, spec, strat = world(out)
    session, _, _ = train_node(model, dataset, spec, strat, steps=1, seed=seed, save_every=1,
                               filename_prefix=f"rt/src{seed}", resume=False)
    return session


def _change_model(out, model, dataset, spec, strat):
    """A LoRA applied to the MODEL at strength 1.0, then at 0.3 (LoraLoaderModelOnly's strength in front of Train)."""
    src = _trained_lora(out, seed=5)
    return (model.with_lora_state(src.lora, src.lora_state, 1.0), dataset, spec, strat), \
        (model.with_lora_state(src.lora, src.lora_state, 0.3), dataset, spec, strat), "other base weights"


def _change_image(out, model, dataset, spec, strat):
    """The middle one of 5 images replaced by another, under the same name."""
    folder, other = (Path(TightropeDemoImages().make(name, 5, 32, seed)[0]) for name, seed in (("five", 0), ("other", 1)))
    before = load_dataset(folder)
    shutil.copyfile(sorted(other.glob("*.png"))[2], sorted(folder.glob("*.png"))[2])
    return (model, before, spec, strat), (model, load_dataset(folder), spec, strat), "another dataset"


def _change_precision(out, model, dataset, spec, strat):
    return (model, dataset, spec, strat), (model, dataset, spec, strategy(compute_dtype="bf16")), "precision"


def _change_token_chunks(out, model, dataset, spec, strat):
    """Token chunks sum a block's weight gradients by chunks: other rounding (found by a helper: resumed silently)."""
    return (model, dataset, spec, strat), (model, dataset, spec, strategy(token_chunks=2, checkpoint="all")), \
        "token_chunks: 1 -> 2"


def _remove_strategy(out, model, dataset, spec, strat):
    """The Memory Strategy disconnected: the node trains with the default one (found in a real ComfyUI server: the
    node returned the finished result of the disconnected strategy's run)."""
    return (model, dataset, spec, strategy(token_chunks=2)), (model, dataset, spec, None), "token_chunks: 2 -> 1"


def _change_existing_lora(out, model, dataset, spec, strat):
    """The LoRA Setup continues from a file that is then replaced under the same name."""
    path = out / "continue_from.safetensors"
    shutil.copyfile(_trained_lora(out, seed=5).last_saved, path)
    inputs = (model, dataset, lora(existing_lora=str(path)), strat)
    replacement = _trained_lora(out, seed=6).last_saved

    def replaced():
        shutil.copyfile(replacement, path)
        return inputs
    return inputs, replaced, "existing_lora: the same name, another file"


@pytest.mark.parametrize("change", [_change_model, _change_image, _change_precision, _change_token_chunks,
                                    _remove_strategy, _change_existing_lora])
@pytest.mark.parametrize("finished", [False, True])
def test_changed_inputs_train_anew_and_say_what(out, comfy, change, finished):
    """Interrupted (or finished), then queued with one input changed: the node must train from its input, to what
    a fresh run of the changed graph gives, and name the change."""
    first, second, named = change(out, *world(out))
    if finished:
        train_node(*first, **KW)
    else:
        _interrupted(comfy, *first)
    second = second() if callable(second) else second
    fresh, _, _ = train_node(*second, **KW, filename_prefix="rt/fresh", resume=False)
    comfy["notes"].clear()
    again, _, _ = train_node(*second, **KW)
    assert any("trains from its input, not from its saved state" in n and named in n for n in comfy["notes"]), \
        comfy["notes"]
    assert again.losses == fresh.losses and _same(again.lora_state, fresh.lora_state)


@pytest.mark.parametrize("finished", [False, True])
def test_a_continued_session_s_node_with_its_strategy_disconnected_trains_with_the_session_s(out, comfy, finished):
    """Train -> Train on with its own Memory Strategy (token_chunks 2); queued again with that strategy disconnected:
    the second node trains with the first's strategy, to what a fresh server gives (found in a real ComfyUI server:
    it returned the disconnected strategy's result, 24 of 36 tensors off)."""
    model, dataset, spec, strat = world(out)
    first, _, _ = train_node(model, dataset, spec, strat, steps=2, filename_prefix="rt/first")
    own = strategy(token_chunks=2)
    if finished:
        train_node(session=first, strat=own, **KW)
    else:
        _interrupted(comfy, session=first, strat=own)
    fresh, _, _ = train_node(session=first, **KW, filename_prefix="rt/fresh", resume=False)
    comfy["notes"].clear()
    again, _, _ = train_node(session=first, **KW)
    assert any("trains from its input, not from its saved state" in n and "token_chunks: 2 -> 1" in n
               for n in comfy["notes"]), comfy["notes"]
    assert again.losses == fresh.losses and _same(again.lora_state, fresh.lora_state)


@pytest.mark.parametrize("finished", [False, True])
@pytest.mark.parametrize("where", ["before", "own"])
def test_memory_settings_edited_before_queueing_again_are_the_ones_trained_with(out, comfy, finished, where):
    """Interrupted (or finished), then queued again with the Memory Strategy edited to move the same values (what a
    user does after running out of memory), on the node before (whose strategy this node inherits) or on its own:
    the node goes on to the same LoRA, with the edited strategy, as a fresh server would (found in a real ComfyUI
    server: it went on with, or returned, the strategy restored from its state file, so an out-of-memory B could
    not be fixed by editing A's Memory Strategy, and B's LoRA metadata named the old strategy)."""
    model, dataset, spec, strat = world(out)
    first, _, _ = train_node(model, dataset, spec, strat, steps=2, filename_prefix="rt/first")
    leaner = strategy(offload_fraction=1.0, checkpoint="all", activation_offload=True)
    own = {"own": dict(strat=strat), "before": {}}[where]
    if finished:
        train_node(session=first, **own, **KW)
    else:
        _interrupted(comfy, session=first, **own)
    edited_input = first.advanced(strategy=leaner) if where == "before" else first  # A re-run with its edit
    edited_own = dict(strat=leaner) if where == "own" else {}
    whole, _, _ = train_node(session=first, **own, **KW, filename_prefix="rt/whole", resume=False)
    again, _, _ = train_node(session=edited_input, **edited_own, **KW)
    assert again.strategy == leaner
    assert again.losses == whole.losses and _same(again.lora_state, whole.lora_state)
