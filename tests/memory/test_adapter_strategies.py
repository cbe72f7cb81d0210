"""DoRA, LoHa and LoKr (peft) train under every memory policy exactly as in plain PyTorch (fp32): layer offload
streams the frozen base weights inside peft's layers (base_layer) and poisons them with NaN while evicted, so a
weight read outside its block's window, or an adapter factor offloaded as if frozen, breaks the comparison. DoRA
reads its base weight directly (for its row norms) and LoHa/LoKr build a full delta weight per forward."""
import pytest
import torch
from peft import inject_adapter_in_model
from torch import nn
from two_stream import TwoStream, train_steps

from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy
from tightrope.training.lora.layers import LoraSpec, lora_parameters
from tightrope.training.lora.algorithms import peft_config

TARGETS = r".*_blocks\.\d+\..*(qkv|proj|mod|shift|txt_to_img|mlp\.[02])"
STRATEGIES = {
    "offload_all+ckpt_all+act": Strategy.of(offload_fraction=1.0, checkpoint="all", activation_offload=True,
                                            compute_dtype="fp32"),
    "offload_half+every2": Strategy.of(offload_fraction=0.5, checkpoint="every_n", checkpoint_every=2,
                                       compute_dtype="fp32", prefetch_depth=0),
}


def adapted_model(algorithm):
    torch.manual_seed(0)
    model = TwoStream().requires_grad_(False)
    inject_adapter_in_model(peft_config(LoraSpec(rank=4, algorithm=algorithm), TARGETS), model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every factor non-zero, so every one gets a gradient
        for p in lora_parameters(model).values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
            p.requires_grad_(True)
    return model


@pytest.mark.parametrize("algorithm", ["dora", "loha", "lokr"])
def test_adapter_trains_alike_under_each_strategy(algorithm):
    ref_losses, ref_grads = train_steps(adapted_model(algorithm), steps=2)
    assert set(ref_grads[0]) == set(lora_parameters(adapted_model(algorithm)))
    assert all(g.abs().max() > 0 for g in ref_grads[0].values()), "some adapter factor got no gradient"
    for name, strategy in STRATEGIES.items():
        model = adapted_model(algorithm)
        base = [p for n, p in model.named_parameters() if ".base_layer." in n and "blocks" in n]
        with MemoryRuntime(model, strategy, "cpu", poison_slots=True, activation_min_bytes=0) as rt:
            streamed = {id(p) for lay in rt.offload.layouts.values() for p, *_ in lay.params}
            assert any(id(p) in streamed for p in base), "no base_layer weight inside peft's layers is offloaded"
            assert not any(id(p) in streamed for p in lora_parameters(model).values())
            losses, grads = train_steps(model, steps=2, runtime=rt)
            counters = rt.counters()
        assert counters["h2d_bytes"] > 0, f"{name}: offloaded base weights were never streamed in"
        # fp32 throughout: the same ops on the same values, only recomputed or moved; 1e-5 covers reduction order
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for step, (g, rg) in enumerate(zip(grads, ref_grads)):
            for n in rg:
                torch.testing.assert_close(g[n], rg[n], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} step {step} grad {n}: {m}")


def test_offload_poison_reaches_peft_base_layers():
    """Negative control: with the LoKr base weights poisoned and never streamed back, the loss is NaN — the
    comparison above does read the offloaded weights inside peft's layers."""
    model = adapted_model("lokr")
    strategy = Strategy.of(offload_fraction=1.0, compute_dtype="fp32")
    with MemoryRuntime(model, strategy, "cpu", poison_slots=True, activation_min_bytes=0) as rt:
        rt.offload.load = lambda index: None  # the bug: never load an offloaded block
        losses, _ = train_steps(model, steps=1, runtime=rt)
    assert torch.isnan(torch.tensor(losses)).all()
    assert isinstance(model.double_blocks[0].qkv.base_layer, nn.Linear)
