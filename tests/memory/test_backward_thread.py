"""Backward on another thread, as on a GPU (tests/helpers/device_thread.py): the autograd engine runs a CUDA backward on
its device thread, with the caller's torch thread-local state but none of Python's, and each node's stream set to the
one its forward ran on. Every CPU test runs backward on the caller's thread; these run the runtime's hooks,
recomputes and gradient hooks where they will run on a GPU. (TIGHTROPE_BACKWARD_THREAD=1 runs the whole suite so.)"""
import threading

import pytest
import torch
from device_thread import backward_on_another_thread
from equivalence import assert_equivalent, run_managed
from sim_streams import simulated_cuda
from two_stream import make_lora_model, train_steps

from tightrope.memory.layer_offload import in_backward
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

# device_thread copies the caller's saved-tensor hooks as the engine does, read with torch 2.8's
# _top_saved_tensors_default_hooks, which torch 2.7 (the oldest supported) does not have
pytestmark = pytest.mark.skipif(not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
                                reason=f"the backward-thread stand-in needs torch 2.8+ (torch {torch.__version__})")


def test_the_worker_gets_what_the_engine_copies_and_nothing_else(monkeypatch):
    stats = backward_on_another_thread(monkeypatch)
    local = threading.local()
    local.value = "forward"
    seen = []

    def unpack(t):
        seen.append(dict(thread=threading.current_thread().name, local=getattr(local, "value", None),
                         grad=torch.is_grad_enabled(), backward=in_backward(),
                         autocast=torch.is_autocast_enabled("cpu"), dtype=torch.get_autocast_dtype("cpu")))
        return t

    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = (x * x).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the engine copies the caller's autocast state
        y.backward()
    assert stats.calls == 1 and x.grad is not None
    assert seen and all(s == dict(thread="autograd-device-thread-0", local=None, grad=False, backward=True,
                                  autocast=True, dtype=torch.bfloat16) for s in seen), seen


def test_an_error_in_backward_reaches_the_caller_with_its_type(monkeypatch):
    backward_on_another_thread(monkeypatch)

    class Interrupted(Exception):
        pass

    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda g: (_ for _ in ()).throw(Interrupted()))
    with pytest.raises(Interrupted):
        y.backward()


def test_a_hook_that_reads_thread_local_state_of_the_forward_is_caught(monkeypatch):
    """The class of bug this emulation is for: state a forward leaves in a threading.local (or a contextvar, or the
    caller's current stream) is not there in a GPU's backward. On the caller's thread it passes; here it fails."""
    local = threading.local()

    def pack(t):
        local.block = "block 3"
        return t

    def unpack(t):
        assert getattr(local, "block", None) == "block 3", "the forward's thread-local state is not here"
        return t

    def step():
        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x * x).sum()
        y.backward()

    monkeypatch.undo()  # the caller's thread (also under TIGHTROPE_BACKWARD_THREAD=1): passes
    step()
    backward_on_another_thread(monkeypatch)
    with pytest.raises(AssertionError, match="thread-local state"):
        step()


def test_the_simulated_streams_worker_starts_on_the_compute_stream(monkeypatch):
    """The engine sets each node's stream to the one its forward ran on (the runtime's forwards: the compute stream),
    whatever stream the caller has current."""
    sim = simulated_cuda(monkeypatch)
    backward_on_another_thread(monkeypatch)
    side = torch.cuda.Stream()
    seen = []
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: seen.append(torch.cuda.current_stream()) or t):
        y = (x * x).sum()
    with torch.cuda.stream(side):
        y.backward()
    assert seen and all(s is sim.compute for s in seen)


STRATEGIES = {
    "offload_checkpoint_acts": dict(offload_fraction=0.5, checkpoint="all", activation_offload=True),
    "full_offload_every_2": dict(offload_fraction=1.0, checkpoint="every_n", checkpoint_every=2,
                                 activation_offload=True),
    "token_chunks": dict(offload_fraction=1.0, checkpoint="all", token_chunks=2),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_runtime_with_backward_on_another_thread_equals_plain_pytorch(monkeypatch, name):
    stats = backward_on_another_thread(monkeypatch)
    result = run_managed(Strategy.of(compute_dtype="fp32", **STRATEGIES[name]))
    assert stats.calls == 2
    assert_equivalent(result)


def test_the_runtime_under_simulated_streams_with_backward_on_another_thread(monkeypatch):
    """Layer and activation offload take their CUDA branches, their backward halves (prefetch, copies back, waits) on
    the worker, whose compute ops the stream simulation logs (the engine copies the dispatch mode stack): same
    numbers as plain PyTorch, no hazard."""
    from sim_branches import cuda_branches
    strategy = Strategy.of(compute_dtype="fp32", offload_fraction=0.5, checkpoint="all", activation_offload=True)
    with simulated_cuda(monkeypatch) as sim:
        cuda_branches(monkeypatch)
        stats = backward_on_another_thread(monkeypatch)
        model = make_lora_model()
        with MemoryRuntime(model, strategy, "cpu", poison_slots=True, activation_min_bytes=0) as rt:
            result = train_steps(model, steps=2, runtime=rt)
    assert stats.calls == 2 and any(n.startswith("autograd-device-thread") for n in sim.flush_threads)
    assert_equivalent(result)
