"""Optimizer offload in the profile, the cost model and the planner: what leaves the device (the optimizer's state and
all gradients but those in flight), what the step pays instead (the CPU step and the LoRA's copy back), the host
memory it takes, and the planner choosing it only where it fits what nothing else fits or is faster by the model."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from two_stream import make_batch, make_lora_model

from tightrope.memory import probe as probe_module
from tightrope.memory.host_memory import HostNeeds
from tightrope.memory.plan_cost import HOST_ADAMW_S_PER_ELEMENT, host_step_s, predict
from tightrope.memory.planner import candidate_strategies, plan
from tightrope.memory.probe import probe_model
from tightrope.memory.profile import Profile
from tightrope.memory.strategy import ShardingConfig, Strategy, StrategyError

MiB = 1 << 20
LORA = [16 * MiB, 24 * MiB, 16 * MiB, 16 * MiB]  # per block; 8 MiB more outside the blocks
OUTSIDE = 8 * MiB
TRAINABLE = sum(LORA) + OUTSIDE  # 80 MiB of fp32 LoRA weights: 20 Mi elements
IN_FLIGHT = 2 * max(LORA) + OUTSIDE  # the block running backward and the one before it, and those outside
S = Strategy.of(offload_fraction=1.0, checkpoint="all")


def _profile(device="cuda", optimizer_s=0.004, host_optimizer_s=0.03, pinned=True, h2d=24e9) -> Profile:
    """Four blocks of 100 MiB with a large LoRA (its gradients and AdamW state, 240 MiB, are worth more than two
    offload slots)."""
    n = len(LORA)
    return Profile(
        device=device, batch=1, block_names=[f"b.{i}" for i in range(n)], block_types=["Block"] * n,
        block_frozen=[100 * MiB] * n, block_packed=[100 * MiB] * n, block_trainable=list(LORA),
        other_weight_bytes=10 * MiB + OUTSIDE, trainable_bytes=TRAINABLE, trainable_numel=TRAINABLE // 4,
        act_full=[400 * MiB] * n, act_ckpt=[10 * MiB] * n, act_shared=MiB, act_other=MiB, fwd_s=[0.01] * n,
        bwd_s=[0.02] * n, other_s=0.001, h2d_bytes_per_s=h2d, optimizer_s=optimizer_s,
        host_optimizer_s=host_optimizer_s, h2d_pinned=pinned)


# -- the cost model ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accumulation, host_buffers", [(1, 2), (4, 3)])
def test_the_device_keeps_only_the_gradients_in_flight(accumulation, host_buffers):
    prof = _profile()
    on = predict(prof, S.replace(optimizer_offload=True), grad_accumulation=accumulation)
    off = predict(prof, S, grad_accumulation=accumulation)
    assert off.breakdown["optimizer"] == 8 * prof.trainable_numel and off.breakdown["gradients"] == TRAINABLE
    assert on.breakdown["optimizer"] == 0 and on.breakdown["gradients"] == IN_FLIGHT == 56 * MiB
    # the host holds the LoRA's copy and its gradients (and, accumulating, one more buffer of them) and AdamW's state
    assert on.breakdown["host_optimizer"] == host_buffers * TRAINABLE + 8 * prof.trainable_numel
    assert off.breakdown["host_optimizer"] == 0
    # nothing else changes: the peak falls by what left, plus its 5 % margin (int truncation: a byte or two)
    same = ("weights", "slots", "activations", "transient", "host_weights", "host_activations")
    assert all(on.breakdown[k] == off.breakdown[k] for k in same)
    left = TRAINABLE + 8 * prof.trainable_numel - IN_FLIGHT
    assert abs(off.peak_bytes - on.peak_bytes - 1.05 * left) <= 2
    # with one block, two blocks' gradients in flight would be more than there are
    one = dataclasses.replace(prof, block_names=["b.0"], block_types=["Block"], block_frozen=[100 * MiB],
                              block_packed=[100 * MiB], block_trainable=[TRAINABLE], act_full=[400 * MiB],
                              act_ckpt=[10 * MiB], fwd_s=[0.01], bwd_s=[0.02], other_weight_bytes=10 * MiB)
    assert predict(one, S.replace(optimizer_offload=True)).breakdown["gradients"] == TRAINABLE


def test_the_step_pays_the_cpu_step_and_the_copy_back_not_the_device_step():
    on_s = S.replace(optimizer_offload=True)
    back = TRAINABLE / 24e9  # the updated LoRA to the device, on the compute stream
    # CUDA, pinned: the gradients' copies to the host (3.5 ms) hide behind backward (4 blocks x 30 ms of compute, the
    # checkpoint's recompute included)
    prof = _profile()
    on, off = predict(prof, on_s), predict(prof, S)
    assert on.step_s - off.step_s == pytest.approx(0.03 + back - 0.004, abs=1e-12)
    assert host_step_s(prof) == pytest.approx(0.03 + back, abs=1e-15)
    # a profile without the CPU step's measurement (older ones) takes the estimate per element
    old = dataclasses.replace(prof, host_optimizer_s=None)
    estimate = HOST_ADAMW_S_PER_ELEMENT * prof.trainable_numel  # 2 ns x 20 Mi elements: 42 ms
    assert predict(old, on_s).step_s - predict(old, S).step_s == pytest.approx(estimate + back - 0.004, abs=1e-12)
    # synchronous copies (CPU; CUDA from pageable memory): the gradients' trip to the host adds as well
    for sync in (_profile(device="cpu"), _profile(pinned=False)):
        on, off = predict(sync, on_s), predict(sync, S)
        assert on.step_s - off.step_s == pytest.approx(0.03 + 2 * back - 0.004, abs=1e-12)
        assert on.bound_s - off.bound_s == pytest.approx(0.03 + 2 * back - 0.004, abs=1e-12)


# -- the planner ---------------------------------------------------------------------------------------------------
def _least(prof: Profile, optimizer_offload: bool) -> int:
    return min(predict(prof, s, offloaded=off, timed=False).peak_bytes
               for s, off in candidate_strategies(prof, Strategy(), optimizer_offload=optimizer_offload))


def test_the_planner_offloads_the_optimizer_only_where_that_fits_what_nothing_else_does_or_is_faster():
    prof = _profile(h2d=2e9)  # a block takes 52 ms to stream in, more than its 30 ms of compute: offload costs time
    least_off, least_on = _least(prof, False), _least(prof, True)
    # the least-peak candidate's twin with optimizer offload: 240 MiB of gradients and AdamW state leave the
    # device, less the 56 MiB in flight, plus the margin on them
    assert abs(least_off - least_on - 1.05 * (TRAINABLE + 8 * prof.trainable_numel - IN_FLIGHT)) <= 2
    budgets = list(range(least_on, least_off + 600 * MiB, 20 * MiB)) + [least_off - 1, 4 << 30]
    faster = steps = 0
    for budget in sorted(budgets):
        allowed = plan(prof, budget)
        assert allowed.predicted_peak_bytes <= budget
        assert steps == 0 or allowed.predicted_step_s <= steps + 1e-12  # a larger budget is never slower
        steps = allowed.predicted_step_s
        try:
            without = plan(prof, budget, optimizer_offload=False)
        except StrategyError:
            assert budget < least_off and allowed.strategy.optimizer.enabled  # nothing else fits
            continue
        assert not without.strategy.optimizer.enabled
        if allowed.strategy.optimizer.enabled:
            # chosen although a plan without fits: by the model it is faster, its twin without does not fit
            assert round(allowed.predicted_step_s, 9) < round(without.predicted_step_s, 9)
            assert predict(prof, allowed.strategy.replace(optimizer_offload=False)).peak_bytes > budget
            assert "the LoRA's optimizer state and gradients wait in host memory" in allowed.explanation
            faster += 1
        else:
            assert allowed.strategy == without.strategy and allowed.predicted_step_s == without.predicted_step_s
    assert faster  # somewhere the 240 MiB it frees buy a faster plan (a deeper prefetch, fewer blocks offloaded)
    assert not plan(prof, 4 << 30).strategy.optimizer.enabled  # with room for everything the device's step wins
    with pytest.raises(StrategyError, match="no strategy fits"):
        plan(prof, least_off - 1, optimizer_offload=False)
    with pytest.raises(StrategyError, match="optimizer offload"):  # the least it needs names the strategy
        plan(prof, least_on - 1)


def test_a_cpu_step_timed_faster_than_the_devices_is_not_a_reason_to_offload():
    """A CPU profile times both steps on the same cores (fused on the host, the default on the device; a shared
    machine's noise): the CPU step counts as the device's when it is faster, so only freed memory makes offload win."""
    prof = _profile(device="cpu", optimizer_s=0.2, host_optimizer_s=0.01)
    back = TRAINABLE / 24e9
    assert host_step_s(prof) == pytest.approx(0.2 + back, abs=1e-15)
    on, off = predict(prof, S.replace(optimizer_offload=True)), predict(prof, S)
    assert on.step_s - off.step_s == pytest.approx(2 * back, abs=1e-12)  # the copy back, the gradients' copies
    roomy = plan(prof, 4 << 30)
    assert not roomy.strategy.optimizer.enabled and roomy.strategy.offload.fraction == 0
    tight = plan(prof, _least(prof, False) - 1)
    assert tight.strategy.optimizer.enabled


def test_candidates_without_optimizer_offload_are_todays():
    prof = _profile()
    without = candidate_strategies(prof, Strategy(), optimizer_offload=False)
    both = candidate_strategies(prof, Strategy())
    assert not any(s.optimizer.enabled for s, _ in without)
    assert both[0::2] == without and [(s.replace(optimizer_offload=False), o) for s, o in both[1::2]] == without
    # a sharded launch cannot offload the optimizer (the Strategy refuses it): no such candidate
    sharded = candidate_strategies(prof, Strategy.of(shard="fsdp"))
    assert sharded and not any(s.optimizer.enabled for s, _ in sharded)
    assert not plan(prof, 4 << 30, sharding=ShardingConfig(mode="fsdp")).strategy.optimizer.enabled


def test_a_host_ram_budget_refuses_the_optimizers_host_memory():
    prof = _profile()
    least_off = _least(prof, False)
    vram = least_off - 1  # only optimizer offload fits the device
    needs = HostNeeds(budget_bytes=1 << 40, model_bytes=500 * MiB, model_8bit_bytes=250 * MiB, copy_bytes=[0] * 4)
    chosen = plan(prof, vram, host=needs)
    host_opt = chosen.prediction.breakdown["host_optimizer"]
    assert chosen.strategy.optimizer.enabled and host_opt == 2 * TRAINABLE + 8 * prof.trainable_numel
    assert needs.need(chosen.prediction) == 500 * MiB + host_opt + chosen.prediction.breakdown["host_activations"]
    assert "of the LoRA's optimizer state, gradients and weights)" in chosen.explanation
    # a host budget a byte short of the least any fitting plan needs: refused, naming the optimizer's share and a
    # VRAM budget whose plan (without optimizer offload) fits the host
    fitting = [predict(prof, s, offloaded=o, timed=False) for s, o in candidate_strategies(prof, Strategy())]
    fitting = [p for p in fitting if p.peak_bytes <= vram]
    least = min(needs.need(p) for p in fitting)
    assert least >= 500 * MiB + host_opt
    with pytest.raises(StrategyError) as e:
        plan(prof, vram, host=dataclasses.replace(needs, budget_bytes=least - 1))
    text = str(e.value)
    assert host_opt == 320 * MiB and "+ 0.31 GiB of the LoRA's optimizer state, gradients and weights (optimizer " \
        "offload))" in text  # GiB to 1/100 above 128 MiB
    assert "raise the VRAM budget (vram_budget_gb) to" in text and "a plan offloading 4 blocks and the activations: " \
        in text  # without the optimizer's share a plan offloading more than the device's fits the host
    assert plan(prof, vram, host=dataclasses.replace(needs, budget_bytes=least)).strategy.optimizer.enabled


# -- the profile and the probe -------------------------------------------------------------------------------------
def test_profile_json_round_trip_with_and_without_the_cpu_step():
    for host_s in (0.03, None):
        prof = _profile(host_optimizer_s=host_s)
        assert Profile.from_json(prof.to_json()) == prof
    # a profile saved before the field existed loads without it: not measured, so estimated
    older = {k: v for k, v in json.loads(_profile().to_json()).items() if k != "host_optimizer_s"}
    loaded = Profile.from_dict(older)
    assert loaded.host_optimizer_s is None
    assert host_step_s(loaded) == HOST_ADAMW_S_PER_ELEMENT * loaded.trainable_numel + TRAINABLE / 24e9
    assert _profile().at_batch(2).host_optimizer_s == 0.03  # the CPU step does not grow with the batch


def test_the_probe_times_a_cpu_step_on_copies(monkeypatch):
    torch.manual_seed(0)
    model = make_lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def inputs():
        x, target = make_batch()
        return x, lambda out: F.mse_loss(out, target)

    prof = probe_model(model, inputs, "cpu", Strategy.of(compute_dtype="fp32"), repeats=0)
    assert prof.host_optimizer_s is not None and prof.host_optimizer_s > 0
    # the user's weights are not stepped, and keep no gradient
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    # a torch without a fused AdamW on the CPU: the default one is timed instead
    trainable = [p for p in model.parameters() if p.requires_grad]
    made = []

    class NoFused(torch.optim.AdamW):
        def __init__(self, params, *args, fused=None, **kw):
            made.append(fused)
            if fused:
                raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                                   "supported devices")
            super().__init__(params, *args, **kw)

    monkeypatch.setattr(probe_module.torch.optim, "AdamW", NoFused)
    assert probe_module._time_host_optimizer(trainable) > 0 and made == [True, None]
    assert probe_module._time_host_optimizer([]) == 0.0
