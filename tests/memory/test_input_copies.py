"""A micro-batch's inputs reach the device on a stream of their own (memory/input_copies.py): a blocking copy of
pageable memory on the compute stream would make the host wait for everything queued there (the micro-batch before's
backward), so the host could never queue a micro-batch ahead of the GPU (found by review: the trainer's inputs and
ComfyUI's conditioning were copied that way, one wait per micro-batch and per validation batch)."""
import torch
from demo_setup import demo_session
from sim_branches import cuda_branches
from sim_streams import simulated_cuda

from tightrope.memory.input_copies import InputCopies
from tightrope.memory.strategy import Strategy
from tightrope.training.trainer import train

CPU = torch.device("cpu")


def test_inputs_are_copied_on_their_stream_and_recorded_on_compute(monkeypatch):
    with simulated_cuda(monkeypatch) as sim:
        cuda_branches(monkeypatch)
        recorded = []
        real_record = torch.Tensor.record_stream
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: (recorded.append((t.data_ptr(), s.name)), real_record(t, s)))
        copies = InputCopies(CPU)
        a, b = torch.randn(3, 4), torch.arange(5)
        (a + 1).sum()  # compute has work queued: the copies must not wait for it
        out = copies(a, None, b)
        assert torch.equal(out[0], a) and torch.equal(out[2], b) and out[1] is None
        assert out[0].data_ptr() != a.data_ptr() and out[2].data_ptr() != b.data_ptr()  # device tensors of their own
        assert sim.counters.blocking == 2  # on a side stream: pageable sources, so blocking copies, waiting for it
        assert sim.host_seen == 0  # the host waited for no compute op
        assert sim.counters.wait_streams == 1  # compute waits for the copies (on the GPU)
        assert sorted(recorded) == sorted([(out[0].data_ptr(), "compute"), (out[2].data_ptr(), "compute")])
        assert copies.stream.name == "inputs" and copies.copies == 2


def test_without_cuda_they_are_the_tensors_moved_as_before():
    a = torch.randn(2)
    assert InputCopies(CPU)(a, None) == (a, None)  # the same tensor: runs stay bit for bit


def test_the_trainer_and_validation_send_every_input_through_them(tmp_path, monkeypatch):
    calls = []
    real = InputCopies.__call__
    monkeypatch.setattr(InputCopies, "__call__", lambda self, *ts: (calls.append(len(ts)), real(self, *ts))[1])
    session = demo_session(tmp_path, strategy=Strategy.of(compute_dtype="fp32"), grad_accumulation=2,
                           validation_fraction=0.25, validation_every=1)
    train(session, 2, device=CPU)
    # 2 steps x 2 micro-batches, and 3 validation passes (steps 0, 1, 2) of 1 batch: 7 tensors each (x_t, t, context,
    # pooled, latents, noise, mask); the reference Flux builds no host tensor in its prediction
    assert calls == [7] * 7, calls
