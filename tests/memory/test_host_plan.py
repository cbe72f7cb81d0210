"""Host RAM in the plan: a refusal names only the changes that would fit by the planner's own host model (else the
least host RAM the run needs), and page-locked activation buffers count as activation offload's arena takes them."""
import dataclasses
import mmap
import re

import pytest
import torch
from two_stream import make_lora_model

from tightrope.memory.blocks import discover_blocks
from tightrope.memory.host_memory import HostNeeds
from tightrope.memory.activation_host import ALIGN, aligned
from tightrope.memory.plan_cost import Prediction, predict
from tightrope.memory.planner import plan
from tightrope.memory.profile import Profile
from tightrope.memory.strategy import Strategy, StrategyError

MiB, GiB, PAGE = 1 << 20, 1 << 30, mmap.PAGESIZE
ABOVE = MiB + 1  # one byte above a power of two: torch's pinned allocator would take 2 MiB for it
OFFLOADED = Strategy.of(offload_fraction=1.0, checkpoint="all", activation_offload=True)
AUTO = "set weight_dtype auto (offloaded blocks stream from the model's own weights)"
EIGHT_BIT = "load the model with 8-bit weights (e.g. weight_dtype fp8_e4m3fn in Load Diffusion Model)"


def _profile(n: int = 4, tensors: int = 3, device: str = "cuda", measured: bool = True) -> Profile:
    """n blocks of 100 MiB, each checkpointed at `tensors` inputs of 1 MiB + 1 byte."""
    return Profile(
        device=device, batch=1, block_names=[f"b.{i}" for i in range(n)], block_types=["Block"] * n,
        block_frozen=[100 * MiB] * n, block_packed=[100 * MiB] * n, block_trainable=[MiB] * n,
        other_weight_bytes=10 * MiB, trainable_bytes=4 * MiB, trainable_numel=MiB, act_full=[400 * MiB] * n,
        act_ckpt=[tensors * ABOVE] * n, act_shared=MiB, act_other=MiB, fwd_s=[0.01] * n, bwd_s=[0.02] * n,
        other_s=0.001, h2d_bytes_per_s=24e9, act_ckpt_allocs=[[ABOVE] * tensors] * n if measured else None)


def _prediction(offloaded, acts=0, peak=1):
    return Prediction(peak_bytes=peak, step_s=1.0, bound_s=1.0, compute_s=1.0, compile_s=0.0,
                      offloaded=tuple(offloaded), breakdown={"host_activations": acts, "host_activations_pinned": acts})


def _refusal(needs: HostNeeds, fitting, scored=()) -> str:
    with pytest.raises(StrategyError) as e:
        needs.keep_fitting([(p, "s") for p in fitting], [(p, "s") for p in scored])
    return str(e.value)


# -- page-locked activation buffers ---------------------------------------------------------------------------------
def _arena(*sizes: int) -> int:
    """What activation offload's page-locked arena takes for buffers of these sizes (memory/activation_host.py)."""
    return -(-sum(aligned(n) for n in sizes) // PAGE) * PAGE


def test_page_locked_activation_buffers_count_as_the_arena_takes_them():
    # 4 blocks x 3 inputs of 1 MiB + 1 byte: 12 MiB + 12 bytes copied out, ALIGN apart in one arena of whole pages;
    # torch's pinned allocator would take 2 MiB for each (24 MiB)
    arena = _arena(*[ABOVE] * 12)
    assert 12 * ABOVE < arena < 12 * ABOVE + 12 * ALIGN + PAGE < 12 * 2 * MiB
    needs = HostNeeds(budget_bytes=GiB, model_bytes=100 * MiB, model_8bit_bytes=100 * MiB, copy_bytes=[0] * 4)
    assert needs.need(predict(_profile(), OFFLOADED)) == 100 * MiB + arena
    # a host budget below that refuses activation offload, which 822 MiB of VRAM needs (without optimizer offload,
    # which would fit there instead: 16 MiB of host memory, 10.5 MiB less VRAM)
    with pytest.raises(StrategyError, match=r"\(the model's 100\.0 MiB \+ 0\.0 MiB of converted weight copies \+ "
                                            r"12\.0 MiB of offloaded activations\)"):
        plan(_profile(), 822 * MiB, host=dataclasses.replace(needs, budget_bytes=112 * MiB), optimizer_offload=False)
    p = plan(_profile(), 822 * MiB, host=dataclasses.replace(needs, budget_bytes=113 * MiB), optimizer_offload=False)
    assert p.strategy.activations.enabled and "Host RAM: 112.0 MiB of your 113.0 MiB" in p.explanation
    b = predict(_profile(), OFFLOADED).breakdown
    assert b["host_activations"] == 4 * 3 * ABOVE and b["host_activations_pinned"] == arena
    # a profile that did not measure the tensors (older ones): each block's bytes as one buffer
    assert predict(_profile(measured=False), OFFLOADED).breakdown["host_activations_pinned"] == _arena(*[3 * ABOVE] * 4)
    # at batch 2 each input is 2 MiB + 2 bytes
    assert predict(_profile().at_batch(2), OFFLOADED).breakdown["host_activations_pinned"] == _arena(*[2 * ABOVE] * 12)
    assert predict(_profile(), OFFLOADED, batch_scale=2).breakdown["host_activations_pinned"] == _arena(*[2 * ABOVE] * 12)
    # pageable buffers (a CPU device, pin_memory off) take what they hold
    for prof, s in ((_profile(device="cpu"), OFFLOADED), (_profile(), OFFLOADED.replace(pin_memory=False))):
        b = predict(prof, s).breakdown
        assert b["host_activations_pinned"] == b["host_activations"] == 4 * 3 * ABOVE


# -- what a refusal names ------------------------------------------------------------------------------------------
def test_changes_are_measured_for_what_the_run_would_change():
    model = make_lora_model()
    blocks = [b.module for b in discover_blocks(model)]

    def changes(dtype, weight_dtype):
        model.to(dtype)
        needs = HostNeeds.measure(model, blocks, weight_dtype, budget_bytes=GiB)
        return [c.split(" (")[0] for c, _ in needs.changes], needs

    # fp32 weights trained as bf16: auto would put fp32 weights on the device (larger), so it is not named
    assert changes(torch.float32, torch.bfloat16)[0] == ["load the model with 8-bit weights"]
    named, needs = changes(torch.bfloat16, torch.float32)  # bf16 weights converted to fp32: auto streams them
    assert named == ["set weight_dtype auto", "load the model with 8-bit weights"]
    assert needs.changes[0][1].copy_bytes == [0] * len(blocks) and sum(needs.copy_bytes) > 0
    assert needs.changes[1][1].model_bytes == needs.model_8bit_bytes < needs.model_bytes
    assert changes(torch.bfloat16, None)[0] == ["load the model with 8-bit weights"]  # auto already
    assert changes(torch.float8_e4m3fn, None)[0] == []  # 8-bit already, auto already: nothing to change


def test_a_refusal_names_weight_dtype_auto_where_it_fits():
    auto = HostNeeds(10 * MiB, 8 * MiB, 8 * MiB, [0, 0])
    needs = HostNeeds(10 * MiB, 8 * MiB, 8 * MiB, [3 * MiB] * 2, ((AUTO, auto),))
    text = _refusal(needs, [_prediction([0, 1])])
    assert text.endswith("needs 14.0 MiB (the model's 8.0 MiB + 6.0 MiB of converted weight copies + 0.0 MiB of "
                         f"offloaded activations); what would fit: {AUTO}: 8.0 MiB of host RAM; or raise "
                         "host_ram_budget_gb to at least 14.0 MiB")
    assert "8-bit" not in text  # the model is 8-bit already


def test_a_refusal_names_a_larger_vram_budget_where_less_offload_fits():
    """Weights already stream in place (weight_dtype auto) and are 8-bit: neither is named. Activation offload is
    what does not fit; the plans without it need more VRAM, and the refusal says how much."""
    needs = HostNeeds(10 * MiB, 8 * MiB, 8 * MiB, [0, 0])
    fitting = [_prediction([0, 1], acts=4 * MiB, peak=GiB)]
    others = [_prediction([1], peak=3 * GiB + 1), _prediction([], peak=5 * GiB), _prediction([], 3 * MiB, 2 * GiB)]
    text = _refusal(needs, fitting, fitting + others)
    assert text.endswith("what would fit: raise the VRAM budget (vram_budget_gb) to 3.01 GiB for a plan offloading 1 "
                         "block: 8.0 MiB of host RAM; or raise host_ram_budget_gb to at least 12.0 MiB")
    assert "weight_dtype" not in text and "8-bit" not in text and "without activation offload" not in text
    text = _refusal(needs, fitting, fitting)  # nothing else was predicted to fit the VRAM budget
    assert text.endswith("offloaded activations); nothing the planner can change fits it: raise host_ram_budget_gb to "
                         "at least 12.0 MiB, or free host memory")


def test_a_model_larger_than_the_budget_is_told_8_bit_weights_only_where_they_fit():
    eight = ((EIGHT_BIT + ")", HostNeeds(4 * MiB, 2 * MiB, 2 * MiB, [0, 0])),)
    needs = HostNeeds(4 * MiB, 8 * MiB, 2 * MiB, [0, 0], eight)
    assert _refusal(needs, [_prediction([0], acts=MiB)]) == (
        "the model's own weights take 8.0 MiB of host memory, more than the host-RAM budget of 4.0 MiB "
        f"(host_ram_budget_gb); what would fit: {EIGHT_BIT}): 3.0 MiB of host RAM; or raise host_ram_budget_gb to at "
        "least 9.0 MiB")
    # with 3 MiB of activations 8-bit weights need 5 MiB: more than the budget, so not named
    assert _refusal(needs, [_prediction([0], acts=3 * MiB)]).endswith(
        "(host_ram_budget_gb); nothing the planner can change fits it: raise host_ram_budget_gb to at least 11.0 MiB, "
        "or free host memory")


def test_what_a_planner_refusal_names_does_fit():
    """Through plan(): each change the refusal names, made, gives a plan."""
    prof = _profile(n=8)
    copies = [100 * MiB] * 8  # weights converted for the offload: a host copy per offloaded block
    auto = HostNeeds(GiB + 150 * MiB, GiB, GiB, [0] * 8)
    needs = HostNeeds(GiB + 150 * MiB, GiB, GiB, copies, ((AUTO, auto),))
    with pytest.raises(StrategyError, match="what would fit") as e:
        plan(prof, 1100 * MiB, host=needs)
    text = str(e.value)
    assert f"{AUTO}: " in text and "8-bit" not in text
    vram = float(re.search(r"raise the VRAM budget \(vram_budget_gb\) to (\d+\.\d+) GiB", text).group(1)) * GiB
    least = float(re.search(r"raise host_ram_budget_gb to at least (\d+\.\d+) GiB", text).group(1)) * GiB
    assert plan(prof, 1100 * MiB, host=auto).strategy.offload.active  # weight_dtype auto
    assert plan(prof, vram, host=needs).predicted_peak_bytes <= vram  # the VRAM budget named
    assert plan(prof, 1100 * MiB, host=HostNeeds(int(least), GiB, GiB, copies))  # the host RAM named
    with pytest.raises(StrategyError):
        plan(prof, vram - 32 * MiB, host=needs)  # about the least VRAM that fits the host budget
