"""Compare a runtime-managed training run against the plain-PyTorch reference."""
import torch
from two_stream import make_lora_model, train_steps

from tightrope.memory.runtime import MemoryRuntime

_REFERENCE = {}


def reference(steps=2):
    if steps not in _REFERENCE:
        _REFERENCE[steps] = train_steps(make_lora_model(), steps=steps)
    return _REFERENCE[steps]


def run_managed(strategy, steps=2, device="cpu"):
    model = make_lora_model()
    with MemoryRuntime(model, strategy, device, poison_slots=True, activation_min_bytes=0) as rt:
        losses, grads = train_steps(model, steps=steps, runtime=rt)
        counters = rt.counters()
    return losses, grads, counters


def assert_equivalent(result, steps=2, rtol=1e-5, atol=1e-6):
    ref_losses, ref_grads = reference(steps)
    losses, grads = result[:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == rg.keys()
        for name in rg:
            torch.testing.assert_close(g[name], rg[name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
