"""Started by torchrun from test_torchrun.py: for several memory strategies, one forward + backward of the tiny
Flux with and without --fsdp on the same inputs. Each rank writes $TIGHTROPE_TEST_RECORD.rank<R> (JSON): per
strategy the two losses, the largest LoRA-gradient difference, whether the blocks were really sharded; and whether
the model left exactly as it came."""
import json
import os

import torch
from torch.distributed.tensor import DTensor

from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy
from tightrope.training import distributed
from tightrope.demo.model import demo_model
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters

STRATEGIES = {
    "checkpoint_all+activation_offload": Strategy.of(checkpoint="all", activation_offload=True, compute_dtype="fp32",
                                                     pin_memory=False),
    "every_n+bf16_weights": Strategy.of(checkpoint="every_n", compute_dtype="bf16", weight_dtype="bf16"),
    "per_block_compile": Strategy.of(compile="per_block", compile_backend="aot_eager", compute_dtype="fp32"),
}


def step(adapter, flux, strategy, fsdp: bool):
    """One forward + backward through the memory runtime: plain, or sharded as `--fsdp` asks (its mesh and the
    Strategy's sharding part from distributed.prepare_ranks)."""
    for p in lora_parameters(flux).values():
        p.grad = None
    device = torch.device("cpu")
    strategy, mesh = distributed.prepare_ranks(flux, strategy, device) if fsdp else (strategy, None)
    assert strategy.sharding.active == fsdp
    with MemoryRuntime(flux, strategy, device, mesh=mesh) as rt:
        model = rt.model
        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
        g = torch.Generator().manual_seed(1)  # the same inputs on every rank and in both runs
        x, t = torch.randn(2, 16, 4, 4, generator=g), torch.rand(2, generator=g)
        context = torch.randn(2, 8, flux.params.context_in_dim, generator=g)
        pooled = torch.randn(2, flux.params.vec_in_dim, generator=g)
        with rt.autocast():
            loss = adapter.predict(model, x, t, context, pooled, 1.0).float().square().mean()
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in lora_parameters(flux).values()])
    return loss.item(), grads, sharded


with distributed.launched(fsdp=True) as par:
    adapter = demo_model(0)
    flux = adapter.flux
    inject_lora(flux, LoraSpec(rank=4, targets="attention_mlp"), "flux")
    with torch.no_grad():  # a non-zero LoRA, so every LoRA weight gets a gradient
        for p in lora_parameters(flux).values():
            p.copy_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    before = {k: v.clone() for k, v in flux.state_dict().items()}
    record = {}
    for name, strategy in STRATEGIES.items():
        plain_loss, plain_grads, _ = step(adapter, flux, strategy, fsdp=False)
        sharded_loss, sharded_grads, sharded = step(adapter, flux, strategy, fsdp=True)
        record[name] = {"losses": [plain_loss, sharded_loss], "sharded_tensors": sharded,
                        "grad_max_diff": (plain_grads - sharded_grads).abs().max().item(),
                        "grad_max": plain_grads.abs().max().item()}
    after = flux.state_dict()
    record["model_unchanged"] = before.keys() == after.keys() and all(
        type(after[k]) is torch.Tensor and after[k].dtype == v.dtype and torch.equal(after[k], v)
        for k, v in before.items())
    with open(f"{os.environ['TIGHTROPE_TEST_RECORD']}.rank{par.rank}", "w") as f:
        json.dump(record, f)
