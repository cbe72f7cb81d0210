"""`python -m tightrope`, plus a recorder for the tests. Each rank writes $TIGHTROPE_TEST_RECORD.rank<R> (JSON):
the losses of every Train node it ran and, under --fsdp, what the sharded copy of the model held (the memory runtime's first step); and
$TIGHTROPE_TEST_RECORD.rank<R>.grads.safetensors: the LoRA gradients of every optimizer step after the all-reduce
(what the optimizer sees) and the LoRA weights they were computed at, so the test can replay the optimizer and bound
the weights' difference by the gradients' difference. Started by
torchrun, or by plain python for the single-process reference."""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from tightrope import cli
from tightrope.memory.sharding import BlockSharding
from tightrope.training import distributed, training_run

record = {"losses": [], "fsdp": []}
grads: dict[str, torch.Tensor] = {}
_train, _all_reduce = training_run.train, distributed.all_reduce_gradients
_shard, _unshard = BlockSharding.apply, BlockSharding.undo
_sharded_models: list = []  # the model each BlockSharding.apply was given (the runtime's first step)


def _recording_all_reduce(params, loss):
    params = list(params)
    loss = _all_reduce(params, loss)
    step = len({k.split(".")[0] for k in grads}) // 2
    for i, p in enumerate(params):
        grads[f"weight{step}.{i}"] = p.detach().clone()
        grads[f"grad{step}.{i}"] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
    return loss


def _recording_train(*args, **kwargs):
    session = _train(*args, **kwargs)
    record["losses"].append(list(session.losses))
    return session


def _recording_shard(self, module):
    model = _shard(self, module)
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    record["fsdp"].append({"sharded_tensors": len(sharded),
                           "local_numel": sum(p.to_local().numel() for p in sharded),
                           "global_numel": sum(p.numel() for p in sharded),
                           "lora_is_shared": all(any(q is p for q in model.parameters())
                                                 for p in module.parameters() if p.requires_grad)})
    _sharded_models.append(module)
    return model


def _recording_unshard(self):
    _unshard(self)
    module = _sharded_models.pop()
    record["fsdp"][-1]["original_untouched"] = not any(isinstance(p, DTensor) for p in module.parameters()) \
        and "FSDP" not in type(module).__name__


training_run.train, BlockSharding.apply, BlockSharding.undo = _recording_train, _recording_shard, _recording_unshard
distributed.all_reduce_gradients = _recording_all_reduce
code = cli.main()
if os.environ.get("TIGHTROPE_TEST_RECORD"):
    with open(f"{os.environ['TIGHTROPE_TEST_RECORD']}.rank{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(record, f)
    save_file(grads, f"{os.environ['TIGHTROPE_TEST_RECORD']}.rank{os.environ.get('RANK', '0')}.grads.safetensors")
sys.exit(code)
