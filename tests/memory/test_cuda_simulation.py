"""What the CPU simulation must catch of the CUDA path: device identity, copy lifetimes, what goes to the host.

"cpu:0" stands in for "cuda": CPU tensors report "cpu", as CUDA tensors report "cuda:0" where "cuda" was asked for,
so a runtime that compares device objects as spelled misses the same way on both.
"""
import contextlib
import weakref

import pytest
import torch
import torch.nn.functional as F
from equivalence import assert_equivalent
from two_stream import make_batch, make_lora_model, train_steps

from tightrope.memory.activation_offload import ActivationOffload
from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy

FP32 = dict(compute_dtype="fp32")
COMPILED = dict(compile="per_block", compile_backend="aot_eager_decomp_partition", **FP32)


def _observe(strategy, device, steps=2):
    """Train under the runtime; return what it did: counters, weight bytes, slot ownership, losses and grads."""
    model = make_lora_model()
    with MemoryRuntime(model, strategy, device, poison_slots=True, activation_min_bytes=0) as rt:
        weights = (rt.predicted_weight_bytes(), rt.device_weight_bytes())
        owned = []
        if rt.offload is not None:
            for i in rt.offloaded:
                rt.offload.load(i)
                owned += [rt.offload.owns(p) for p in rt.blocks[i].module.parameters() if not p.requires_grad]
        losses, grads = train_steps(model, steps=steps, runtime=rt)
        counters = rt.counters()
    return dict(counters=counters, weights=weights, owned=owned), (losses, grads)


@pytest.mark.parametrize("kw", [{"offload_fraction": 1.0},
                                {"offload_fraction": 0.5, "checkpoint": "all", "activation_offload": True}])
def test_device_spelling_changes_nothing(kw):
    """Offloaded weights saved by non-checkpointed blocks must be packed as slot references, activations must go to
    the host, and the memory accounting must see the device's tensors, whichever way the device is spelled."""
    strategy = Strategy.of(**kw, **FP32)
    bare, bare_run = _observe(strategy, "cpu")
    indexed, indexed_run = _observe(strategy, "cpu:0")
    assert bare["owned"] and all(bare["owned"])
    assert indexed == bare
    assert bare["weights"][0] == bare["weights"][1]
    if strategy.activations.enabled:
        assert bare["counters"]["d2h_bytes"] > 0
    for run in (bare_run, indexed_run):
        assert_equivalent(run)


def test_devices_are_normalised_to_what_tensors_report():
    from tightrope.memory.devices import normalize_device
    assert normalize_device("cpu:0") == torch.empty(1, device="cpu:0").device == torch.device("cpu")
    assert MemoryRuntime(make_lora_model(), Strategy(), "cpu:0").device == torch.device("cpu")


def _count_live_copies(monkeypatch):
    """Count device copies of activations alive at once, independently of the store's own bookkeeping."""
    live, peak = [0], [0]
    real = ActivationOffload._bring_back

    def freed():
        live[0] -= 1

    def bring_back(self, stored):
        real(self, stored)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(stored.back, freed)

    monkeypatch.setattr(ActivationOffload, "_bring_back", bring_back)
    return live, peak


@pytest.mark.parametrize("extra", [{}, {"offload_fraction": 1.0}])
def test_activation_copies_die_with_their_last_use(monkeypatch, extra):
    """During backward only the prefetch window is on the device: the inputs of the block in backward and of the
    block before it (at most 2 + 2 tensors: a double block takes img and txt), plus the 2 tensors every block shares
    (vec, pe). Keeping every copy to the end of the step would hold all 3 * 2 + 3 * 1 + 2 = 11."""
    live, peak = _count_live_copies(monkeypatch)
    model = make_lora_model()
    strategy = Strategy.of(checkpoint="all", activation_offload=True, **extra, **FP32)
    with MemoryRuntime(model, strategy, "cpu", poison_slots=True, activation_min_bytes=0) as rt:
        result = train_steps(model, steps=2, runtime=rt)
        assert live[0] == 0, "copies outlived the step"
        assert 0 < peak[0] <= 2 + 2 + 2, f"{peak[0]} activation copies were alive at once"
        assert rt.acts.live_copies == 0
    assert_equivalent(result)


def test_the_store_counts_its_live_copies():
    model = make_lora_model()
    strategy = Strategy.of(checkpoint="all", activation_offload=True, **FP32)
    with MemoryRuntime(model, strategy, "cpu", activation_min_bytes=0) as rt:
        train_steps(model, steps=1, runtime=rt)
        # the peak of the step just ended (reset when the next one starts): the window, as above, never all 11
        assert 3 <= rt.acts.peak_live_copies <= 6 and rt.acts.live_copies == 0


def _weight_views(model, keep=None):
    with MemoryRuntime(model, Strategy.of(offload_fraction=1.0, prefetch_depth=0, **FP32), "cpu:0",
                       poison_slots=True) as rt:
        if keep is not None:  # a consumer that holds on to what it unpacks
            real = rt.offload.unpack
            rt.offload.unpack = lambda ref: keep.append(real(ref)) or keep[-1]
        result = train_steps(model, steps=2, runtime=rt)
        return rt.offload.counters, result


def test_weight_views_never_outlive_their_slot():
    """Non-checkpointed offloaded blocks save weights as slot references: each view they unpack is used by one
    backward node and must be gone before its slot is refilled with another block (else backward would read that
    block's weights). With one slot (prefetch_depth 0) any view alive across a block change would be stale."""
    counters, result = _weight_views(make_lora_model())
    assert counters.stale_views == 0 and counters.live_views == 0
    assert counters.peak_live_views == 1  # one node's saved weight at a time
    assert_equivalent(result)
    held = []
    counters, _ = _weight_views(make_lora_model(), keep=held)  # negative control: the count sees held views
    assert counters.stale_views > 0 and counters.live_views == len(held) > 0


@pytest.mark.parametrize("strategy", [
    Strategy.of(activation_memory_budget=0.5, activation_offload=True, offload_fraction=0.5, **COMPILED),
    Strategy.of(activation_memory_budget=0.5, activation_offload=True, **COMPILED),
    Strategy.of(checkpoint="all", activation_offload=True, offload_fraction=0.5, **FP32),
], ids=["compiled+offload", "compiled", "eager"])
def test_parameters_never_go_through_activation_offload(monkeypatch, strategy):
    """The bytes sent to the host hold no parameter storage: resident frozen weights, LoRA weights and slot views
    saved by a compiled graph stay where they are."""
    model = make_lora_model()
    sent = []
    real = ActivationOffload.pack

    def pack(self, t, block):
        out = real(self, t, block)
        if out is not t:
            sent.append(t.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(ActivationOffload, "pack", pack)
    with MemoryRuntime(model, strategy, "cpu", poison_slots=True, activation_min_bytes=0) as rt:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if rt.offload is not None:
            params |= rt.offload.device_storage_ptrs()
        result = train_steps(model, steps=2, runtime=rt)
    assert sent, "nothing was activation-offloaded"
    assert not params & set(sent), "parameter storage went to the host"
    assert_equivalent(result, rtol=1e-5, atol=1e-6)


def test_host_memory_falls_back_to_pageable():
    """Without an accelerator nothing is page-locked, and the runtime says so (refusals: test_activation_host.py)."""
    with MemoryRuntime(make_lora_model(), Strategy.of(offload_fraction=0.5, activation_offload=True,
                                                       checkpoint="all"), "cpu") as rt:
        assert not rt.host_memory_pinned()


def test_a_second_unpack_fetches_the_copy_again():
    """A packed activation can be unpacked more often than it was packed (a second backward through the same graph
    recomputes every checkpointed block again): the copy handed out first is gone, so it is fetched again from the
    host copy, and the gradients are still right."""
    def grads(strategy):
        model = make_lora_model()
        inputs, target = make_batch()
        with MemoryRuntime(model, strategy, "cpu", activation_min_bytes=0) if strategy else contextlib.nullcontext():
            loss = F.mse_loss(model(**inputs), target)
            loss.backward(retain_graph=True)
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    managed = grads(Strategy.of(checkpoint="all", activation_offload=True, **FP32))
    plain = grads(None)
    for name, g in plain.items():
        torch.testing.assert_close(managed[name], g, rtol=1e-5, atol=1e-6)
