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


def _train(tmp_path, steps=3, **strategy):
    session = demo_session(tmp_path, strategy=Strategy.of(**(EVERYTHING | strategy)), grad_accumulation=2,
                           ema_decay=0.9)
    return train(session, steps, device=CPU)


@pytest.mark.parametrize("offload_fraction", [0.5, 1.0])
def test_the_trainer_under_simulated_streams_trains_as_on_the_cpu(tmp_path, monkeypatch, offload_fraction):
    plain = _train(tmp_path, offload_fraction=offload_fraction)
    with simulated_cuda(monkeypatch) as sim:  # its exit fails on any hazard the run left
        cuda_branches(monkeypatch)
        simulated = _train(tmp_path, offload_fraction=offload_fraction)
        counters, names = sim.counters, {s.name for s in sim.streams}
    assert {"layers", "acts", "optimizer", "ema"} <= names  # every CUDA branch ran
    assert counters.deferred > 0 and counters.flushed == counters.deferred and counters.pending_at_exit == 0
    assert counters.checked_copies == counters.deferred + counters.blocking and counters.host_ops > 0
    assert simulated.losses == plain.losses
    for key, value in plain.lora_state.items():
        assert torch.equal(simulated.lora_state[key], value), key
    for key, value in plain.ema_state.items():
        assert torch.equal(simulated.ema_state[key], value), key
