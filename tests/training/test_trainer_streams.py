"""The trainer itself (not a test loop) under the simulated CUDA streams (tests/helpers/sim_streams.py): layer
offload, activation offload, optimizer offload and the EMA take their CUDA branches on the "cpu" device, with
gradient accumulation, and the run must equal the plain CPU run bit for bit with no ordering or lifetime hazard.

Why bit for bit: the simulation only changes when copies run, never what is computed (every op is the same CPU op
on the same values), so any difference is a copy read before it landed or a buffer reused under a queued copy."""
import pytest
import torch
from demo_setup import demo_session
from sim_streams import cuda_branches, simulated_cuda

from tightrope.memory.strategy import Strategy
from tightrope.training.trainer import train

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
    # fp16: HostGradScaler unscales the host gradients (its scale read back to the host first)
    "fp16_scaled": (dict(compute_dtype="fp16"), {}, {"layers", "acts", "optimizer", "ema"}),
}


def _train(tmp_path, strategy, config, steps=3):
    session = demo_session(tmp_path, strategy=Strategy.of(**(EVERYTHING | strategy)), grad_accumulation=2,
                           ema_decay=0.9, **config)
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
