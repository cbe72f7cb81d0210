"""The trainer itself (not a test loop) under the simulated CUDA streams (tests/helpers/sim_streams.py): layer
offload, activation offload, optimizer offload and the EMA take their CUDA branches on the "cpu" device, with
gradient accumulation, and the run must equal the plain CPU run bit for bit with no ordering or lifetime hazard.

Why bit for bit: the simulation only changes when copies run, never what is computed (every op is the same CPU op
on the same values), so any difference is a copy read before it landed or a buffer reused under a queued copy."""
import dataclasses

import pytest
import torch
from demo_setup import demo_session
from safetensors.torch import load_file
from sim_branches import cuda_branches
from sim_streams import simulated_cuda

from tightrope.memory.strategy import Strategy
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")
EVERYTHING = dict(compute_dtype="fp32", offload_fraction=0.5, checkpoint="all", activation_offload=True,
                  optimizer_offload=True)
CASES = {  # name: (strategy changes, config changes, the side streams that must have copied)
    "half_offload": ({}, {}, {"layers", "acts", "optimizer", "ema"}),
    "full_offload_validated": (dict(offload_fraction=1.0), dict(validation_fraction=0.25, validation_every=1),
                               {"layers", "acts", "optimizer", "ema"}),
    "token_chunks": (dict(offload_fraction=1.0, activation_offload=False, token_chunks=2), {},
                     {"layers", "optimizer", "ema"}),
    "bf16": (dict(compute_dtype="bf16"), {}, {"layers", "acts", "optimizer", "ema"}),
    # LoRA variants whose forward reads the (offloaded) base weight: DoRA's norm, LoKr's Kronecker factors
    # (and LoRA dropout: its masks drawn on the device's generator)
    "dora_dropout": ({}, dict(lora=dict(algorithm="dora", dropout=0.1)), {"layers", "acts", "optimizer", "ema"}),
    "lokr": ({}, dict(lora=dict(algorithm="lokr")), {"layers", "acts", "optimizer", "ema"}),
    # fp16: HostGradScaler unscales the host gradients (its scale read back to the host first)
    "fp16_scaled": (dict(compute_dtype="fp16"), {}, {"layers", "acts", "optimizer", "ema"}),
    # Adafactor's host `step` tensors are made by torch.tensor (no allocation op the log sees), where the CPU
    # allocator may have put the freed norms of the finite check and clip_grad_norm_ (of host gradients, but logged
    # as compute's)
    "adafactor": ({}, dict(optimizer="adafactor"), {"layers", "acts", "optimizer", "ema"}),
}


def _train(tmp_path, strategy, config, steps=3):
    config = dict(config)
    lora = config.pop("lora", None)
    session = demo_session(tmp_path, strategy=Strategy.of(**(EVERYTHING | strategy)), grad_accumulation=2,
                           ema_decay=0.9, **config)
    if lora is not None:
        session = session.advanced(lora=dataclasses.replace(session.lora, **lora))
    return train(session, steps, device=CPU)


@pytest.mark.parametrize("name", list(CASES))
def test_the_trainer_under_simulated_streams_trains_as_on_the_cpu(tmp_path, monkeypatch, name):
    strategy, config, owners = CASES[name]
    plain = _train(tmp_path, strategy, config)
    with simulated_cuda(monkeypatch) as sim:  # its exit fails on any hazard the run left
        cuda_branches(monkeypatch)
        simulated = _train(tmp_path, strategy, config)
        counters = sim.counters
        copied = {s.name for s in sim.streams if s.deferred}
    assert copied == owners  # every CUDA branch ran and queued copies
    assert counters.flushed == counters.deferred and counters.pending_at_exit == 0
    assert counters.checked_copies == counters.deferred + counters.blocking and counters.host_ops > 0
    assert simulated.losses == plain.losses and simulated.validation_losses == plain.validation_losses
    if config.get("validation_fraction"):
        assert len(plain.validation_losses) == 4  # steps 0-3
    for key, value in plain.lora_state.items():
        assert torch.equal(simulated.lora_state[key], value), key
    for key, value in plain.ema_state.items():
        assert torch.equal(simulated.ema_state[key], value), key


def test_saves_and_a_continued_run_under_simulated_streams_equal_the_cpu_s(tmp_path, monkeypatch):
    """Saving every step reads the LoRA (and, for DoRA, the offloaded base weights) while copies are in flight; a
    second train() call goes on from the returned session. Files and states equal the plain CPU run's, bit for bit."""
    def run(folder):
        session = demo_session(tmp_path, strategy=Strategy.of(**EVERYTHING), grad_accumulation=2, ema_decay=0.9)
        session = session.advanced(lora=dataclasses.replace(session.lora, algorithm="dora"))
        first = train(session, 2, device=CPU, save=SaveTarget(folder, "run", every=1))
        return train(first, 1, device=CPU, save=SaveTarget(folder, "run", every=1))

    plain = run(tmp_path / "plain")
    with simulated_cuda(monkeypatch):
        cuda_branches(monkeypatch)
        simulated = run(tmp_path / "simulated")
    assert simulated.losses == plain.losses and len(plain.saved) == 3
    for ours, theirs in zip(simulated.saved, plain.saved):
        mine, reference = load_file(ours), load_file(theirs)
        assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in reference)
    for ours, theirs in ((simulated.lora_state, plain.lora_state), (simulated.ema_state, plain.ema_state)):
        assert all(torch.equal(ours[k], v) for k, v in theirs.items())


class Interrupted(Exception):
    """As ComfyUI's interrupt: raised by an op in the middle of a step."""


def test_a_step_interrupted_with_copies_in_flight_ends_without_a_hazard(tmp_path, monkeypatch):
    """Cancelled mid-backward of the second step, while gradient copies to the host and activation copies back are
    queued: the run ends interrupted with its first step, and the undo waits for every queued copy before it
    unregisters or frees the memory they use (else: a hazard, and this test fails at the simulation's exit)."""
    from tightrope.memory.activation_offload import ActivationOffload

    queued_at_interrupt, calls, stop_at = [], [], []
    real_unpack = ActivationOffload.unpack

    def unpack(self, stored):
        calls.append(1)
        if stop_at and len(calls) == stop_at[0]:
            queued_at_interrupt.append({s.name for s in sim.streams if s.pending})
            raise Interrupted()
        return real_unpack(self, stored)

    monkeypatch.setattr(ActivationOffload, "unpack", unpack)
    session = demo_session(tmp_path, strategy=Strategy.of(**EVERYTHING), grad_accumulation=2, ema_decay=0.9)
    with simulated_cuda(monkeypatch) as sim:
        cuda_branches(monkeypatch)
        first = train(session, 1, device=CPU)
        stop_at.append(len(calls) + len(calls) // 4)  # step 2, half way through its first micro-batch
        calls.clear()
        result = train(session, 3, device=CPU, interrupts=(Interrupted,))
    assert result.step == 1 and result.interrupted and result.losses == first.losses
    assert queued_at_interrupt and {"optimizer", "acts"} <= queued_at_interrupt[0], queued_at_interrupt
