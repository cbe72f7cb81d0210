"""EMA of the LoRA weights: equals a hand-computed EMA, carries over continued sessions, and the Save node writes it
as a second ComfyUI LoRA file ending in _ema. (Resume restoring it bit for bit: test_optimizers.py.) Its copy to a
page-locked host buffer, folded in on a worker thread, runs here through the CUDA runtime's model (fake_cudart.py)."""
import dataclasses
import gc
import mmap
import re
import threading

import pytest
import torch
from demo_setup import demo_session
from ema_reference import change_weights, lora_like_weights, reference_ema
from fake_cudart import FakeCudart, StraddleCheck

from tightrope.memory import host_pinning
from tightrope.memory.ema import UPDATES_KEY, CpuEma, ema_weights
from tightrope.nodes import host
from tightrope.nodes.save_node import TightropeSaveLora
from tightrope.training.lora.files import lora_file_tensors, read_lora_file
from tightrope.training.train_config import ConfigError, TrainConfig
from tightrope.training import trainer
from tightrope.training.trainer import train

CPU = torch.device("cpu")
DECAY = 0.75


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """A session one step in (no EMA), then 3 steps with the EMA: one step per call and in one call."""
    start = train(demo_session(tmp_path_factory.mktemp("ema")), 1, device=CPU)
    start = start.advanced(config=dataclasses.replace(start.config, ema_decay=DECAY))
    steps = [start]
    for _ in range(3):
        steps.append(train(steps[-1], 1, device=CPU))
    return steps, train(start, 3, device=CPU)


def test_ema_equals_a_hand_computed_ema(ema_run):
    steps, whole = ema_run
    hand = {k: v.double() for k, v in steps[0].lora_state.items()}  # the EMA starts at the weights it starts from
    for n, s in enumerate(steps[1:]):  # diffusers' warm-up: decay min(DECAY, (1 + n) / (10 + n)) at update n
        decay = min(DECAY, (1 + n) / (10 + n))
        hand = {k: decay * hand[k] + (1 - decay) * s.lora_state[k].double() for k in hand}
    biggest = max(v.abs().max().item() for v in hand.values())
    # each of the 3 fp32 updates rounds once or twice (a lerp) by at most 2**-24 of the largest value, and earlier
    # rounding errors only shrink (multiplied by DECAY < 1): 2 * 3 * 2**-24 * biggest bounds the difference
    atol = 6 * 2**-24 * biggest
    assert ema_weights(whole.ema_state).keys() == hand.keys() and whole.ema_state[UPDATES_KEY].item() == 3
    for k, v in hand.items():
        assert whole.ema_state[k].dtype == torch.float32
        torch.testing.assert_close(whole.ema_state[k].double(), v, rtol=0, atol=atol)
    assert any(not torch.equal(whole.ema_state[k], whole.lora_state[k]) for k in hand)  # it is not the weights
    # continued sessions carry the EMA and its update count: one step per node run gives the one-call EMA, bit for bit
    assert all(torch.equal(steps[-1].ema_state[k], v) for k, v in whole.ema_state.items())


def test_save_node_writes_the_ema_as_a_second_comfyui_lora_file(ema_run, tmp_path):
    _, whole = ema_run
    with host.headless(tmp_path):
        paths = TightropeSaveLora().save(whole, "ema_test/run")["ui"]["text"]
        only_lora = TightropeSaveLora().save(whole, "ema_test/no_ema", save_ema=False)["ui"]["text"]
    assert [p.rsplit("/", 1)[1] for p in paths] == ["run_00001_.safetensors", "run_ema_00001_.safetensors"]
    assert len(only_lora) == 1
    normal, _ = read_lora_file(paths[0])
    ema, meta = read_lora_file(paths[1])
    assert ema.keys() == normal.keys()  # the same ComfyUI keys (lora_A/B + alpha), from the same writer
    expected = lora_file_tensors(ema_weights(whole.ema_state), whole.lora)
    assert all(torch.equal(ema[k], v) for k, v in expected.items())
    assert meta["tightrope.ema_decay"] == repr(DECAY) and meta["tightrope.steps"] == "4"


def test_a_lora_and_its_ema_keep_one_number_after_a_save_stopped_between_them(ema_run, tmp_path):
    """A stop during the Save node that wrote the LoRA but not its EMA, then the save again (--resume): the pair
    used to come out as run_00002_ beside run_ema_00001_ (each file's counter chosen on its own; found by a helper
    driving the CLI). Both now take the first number free for both, whichever files a stop left."""
    _, whole = ema_run
    folder = tmp_path / "ema_test"
    folder.mkdir()
    (folder / "run_00001_.safetensors").write_bytes(b"the LoRA of the stopped save")
    (folder / "run_ema_00001_.safetensors").write_bytes(b"an earlier pair")
    (folder / "run_ema_00002_.safetensors").write_bytes(b"an EMA whose LoRA was deleted")
    with host.headless(tmp_path):
        paths = TightropeSaveLora().save(whole, "ema_test/run")["ui"]["text"]
        again = TightropeSaveLora().save(whole, "ema_test/run")["ui"]["text"]
    assert [p.rsplit("/", 1)[1] for p in paths] == ["run_00003_.safetensors", "run_ema_00003_.safetensors"]
    assert [p.rsplit("/", 1)[1] for p in again] == ["run_00004_.safetensors", "run_ema_00004_.safetensors"]


def test_a_session_without_ema_saves_one_file(tmp_path):
    session = train(demo_session(tmp_path), 1, device=CPU)
    assert session.ema_state is None
    with host.headless(tmp_path / "out"):
        assert len(TightropeSaveLora().save(session, "one")["ui"]["text"]) == 1


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5, float("nan")])
def test_ema_decay_outside_0_1_is_a_config_error(decay):
    with pytest.raises(ConfigError, match=rf"ema_decay={decay!r} (is out of range: use a number between 0 and 1|is "
                                          "not a finite number)"):
        TrainConfig(ema_decay=decay)


def test_the_warm_up_forgets_the_untrained_start():
    """A weight trained linearly from 0 to 1 over 1000 steps: at decay 0.999 without a warm-up the EMA was 0.368 (the
    untrained start still weighing 0.999^1000 = 0.37). With diffusers' warm-up it is 0.9, computed here in float64;
    the fp32 average rounds 1000 times by at most 2**-24 each, and earlier errors only shrink: atol 1000 * 2**-24.
    A state saved without an update count (before it was kept) goes on with the full decay."""
    param = torch.nn.Parameter(torch.zeros(1))
    ema, reference = CpuEma({"w": param}, 0.999), 0.0
    for n in range(1000):
        param.data.fill_((n + 1) / 1000)
        ema.update()
        decay = min(0.999, (1 + n) / (10 + n))
        reference = decay * reference + (1 - decay) * (n + 1) / 1000
    assert ema.shadow["w"].item() == pytest.approx(reference, abs=1000 * 2**-24) and reference > 0.89
    old = CpuEma({"w": param}, 0.999, {"w": torch.zeros(1)})
    old.update()
    assert old.updates == 10 ** 9 + 1 and old.shadow["w"].item() == pytest.approx(0.001)


def test_cpu_ema_refuses_a_state_of_other_weights():
    params = {"a": torch.nn.Parameter(torch.zeros(2, 3))}
    with pytest.raises(ValueError, match="the EMA state of 'a' has shape \\(3, 2\\)"):
        CpuEma(params, 0.9, {"a": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="does not match the trained weights.*another LoRA setup"):
        CpuEma(params, 0.9, {"b": torch.zeros(2, 3)})


def test_new_inputs_follow_the_0_1_inputs_with_tooltips_so_saved_workflows_keep_loading():
    from tightrope.nodes.dataset_nodes import TightropeLoadDataset
    from tightrope.nodes.train_node import TightropeTrain
    # each comes right after the optional inputs its node had in version 0.1 (listed here), so old widgets_values
    # lists still fit; later features may follow it
    for node, name, default, optional_0_1 in (
            (TightropeTrain, "ema_decay", 0.0, ["session", "model", "dataset", "lora", "strategy"]),
            (TightropeLoadDataset, "mask", "none", []), (TightropeSaveLora, "save_ema", True, [])):
        optional = list(node.INPUT_TYPES()["optional"])
        assert optional[:len(optional_0_1) + 1] == optional_0_1 + [name]
        optional = node.INPUT_TYPES()["optional"]
        assert optional[name][1]["default"] == default and optional[name][1]["tooltip"]


def test_updates_folded_in_later_are_the_eager_ema_bit_for_bit():
    steps, decay = 30, 0.75  # past the warm-up: (1 + n) / (10 + n) reaches 0.75 at n = 26
    expected = reference_ema(lora_like_weights(), decay, steps)
    for cudart in (FakeCudart(), None):  # page-locked (the copy folded in later), and the eager CPU path
        params, g = lora_like_weights(), torch.Generator().manual_seed(1)
        ema = CpuEma(params, decay, cudart=cudart)
        for n in range(steps):
            change_weights(params, g)
            ema.update()
        state = ema.state_dict()
        assert state[UPDATES_KEY].item() == steps
        assert all(torch.equal(state[k], v) for k, v in expected[-1].items())
        ema.close()


def test_the_host_buffer_is_registered_once_and_each_update_is_folded_in_off_the_main_thread(monkeypatch):
    fake, params, g = FakeCudart(), lora_like_weights(), torch.Generator().manual_seed(1)
    expected = reference_ema(lora_like_weights(), 0.9, 4)
    ema = CpuEma(params, 0.9, cudart=fake)
    assert len(fake.registered) == 1 and 8 not in fake.flags.values()  # one buffer, writable: the device writes it
    (start, nbytes), = fake.live.items()
    assert start <= ema._flat.data_ptr() and ema._flat.data_ptr() + ema._flat.nbytes <= start + nbytes
    gate, folds = threading.Event(), []
    real_fold = CpuEma._fold

    def held_fold(self, flat, decay):  # the fold waits for the test's word: update() must not wait for it
        folds.append(threading.current_thread() is not threading.main_thread())
        assert gate.wait(30)
        real_fold(self, flat, decay)
    monkeypatch.setattr(CpuEma, "_fold", held_fold)
    for n in range(4):
        gate.clear()
        change_weights(params, g)
        with StraddleCheck(fake):  # the copy into the buffer lies wholly inside the registered range
            ema.update()  # returns with its fold still held
        gate.set()
        read = ema.state_dict() if n % 2 else ema.shadow  # any read sees the last update
        assert all(torch.equal(read[k], v) for k, v in expected[n].items())
    assert folds == [True] * 4  # each folded in on the worker thread, not in update()
    assert len(fake.registered) == 1  # allocated and registered once, not per update
    change_weights(params, g)
    ema.update()
    ema.close()
    assert not fake.live  # unpinned: a long-lived process (a ComfyUI server) keeps no pinned memory after a run
    after_close = ema.state_dict()  # close folded the update in flight in
    assert not torch.equal(after_close["a"], expected[-1]["a"]) and after_close[UPDATES_KEY].item() == 5
    change_weights(params, g)
    ema.update()  # closed: a blocking copy, folded in at once
    assert not torch.equal(ema._shadow["a"], after_close["a"])


def test_a_buffer_over_several_registrations_is_copied_in_parts(monkeypatch):
    """One registration per page (as 1 GiB pieces cut a LoRA of more than 1 GiB): no copy spans an edge."""
    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", mmap.PAGESIZE)
    fake, params, g = FakeCudart(), lora_like_weights(), torch.Generator().manual_seed(1)
    expected = reference_ema(lora_like_weights(), 0.9, 3)
    ema = CpuEma(params, 0.9, cudart=fake)
    assert len(fake.registered) > 1
    with StraddleCheck(fake):
        for _ in range(3):
            change_weights(params, g)
            ema.update()
        state = ema.state_dict()
    ema.close()
    assert all(torch.equal(state[k], v) for k, v in expected[-1].items())


def test_an_ema_dropped_without_close_unpins_its_buffer():
    fake, params = FakeCudart(), lora_like_weights()
    ema = CpuEma(params, 0.9, cudart=fake)
    ema.update()
    ema.state_dict()  # its fold is done: nothing on the worker holds it
    assert fake.live
    del ema
    gc.collect()
    assert not fake.live


def test_refused_pinning_is_one_warning_and_the_same_ema():
    params, g = lora_like_weights(), torch.Generator().manual_seed(1)
    expected = reference_ema(lora_like_weights(), 0.9, 3)
    fake = FakeCudart(refuse=2)
    with pytest.warns(RuntimeWarning) as record:
        ema = CpuEma(params, 0.9, cudart=fake)
    assert len(record) == 1
    assert re.fullmatch(r"tightrope: could not page-lock [\d.]+ KiB of host memory for the EMA in place \(out of memory "
                        r"that can be page-locked: out of memory, error 2\); each step's copy of the LoRA weights to "
                        r"it waits for the GPU \(slower copies; free host RAM\)", str(record[0].message))
    assert not fake.live
    for n in range(3):
        change_weights(params, g)
        ema.update()  # a blocking copy, folded in at once
        assert all(torch.equal(ema._shadow[k], v) for k, v in expected[n].items())
    ema.close()


def test_the_trainer_closes_the_ema_at_the_end_of_a_run_and_when_it_fails(ema_run, monkeypatch):
    """Page-locked through the model of the CUDA runtime: the run's EMA is the eager one bit for bit (the saves and
    the session read it after the last update, and after close), and nothing stays pinned."""
    fake, made, closed = FakeCudart(), [], []

    class Recorded(CpuEma):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, cudart=fake, **kwargs)
            made.append(self)

        def close(self):
            closed.append(self)
            super().close()
    monkeypatch.setattr(trainer, "CpuEma", Recorded)
    steps, whole = ema_run
    pinned = train(steps[0], 3, device=CPU)
    assert len(made) == 1 and closed == made and fake.registered and not fake.live
    assert pinned.ema_state.keys() == whole.ema_state.keys()
    assert all(torch.equal(pinned.ema_state[k], v) for k, v in whole.ema_state.items())

    def broken(*args):
        raise RuntimeError("the step failed")
    monkeypatch.setattr(trainer, "_update", broken)
    with pytest.raises(RuntimeError, match="the step failed"):
        train(steps[0], 1, device=CPU)
    assert len(made) == 2 and closed == made and not fake.live
