"""`python -m tightrope`, plus a recorder for the tests. Each rank writes $TIGHTROPE_TEST_RECORD.rank<R> (JSON):
the losses of every Train node it ran and, under --fsdp, what the sharded copy of the model held. Started by
torchrun, or by plain python for the single-process reference."""
import contextlib
import json
import os
import sys

from torch.distributed.tensor import DTensor

from tightrope import cli
from tightrope.training import distributed, training_run

record = {"losses": [], "fsdp": []}
_train, _sharded_base = training_run.train, distributed.sharded_base


def _recording_train(*args, **kwargs):
    session = _train(*args, **kwargs)
    record["losses"].append(list(session.losses))
    return session


@contextlib.contextmanager
def _recording_sharded_base(module, strategy, device):
    with _sharded_base(module, strategy, device) as model:
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
        record["fsdp"].append({"sharded_tensors": len(sharded),
                               "local_numel": sum(p.to_local().numel() for p in sharded),
                               "global_numel": sum(p.numel() for p in sharded),
                               "lora_is_shared": all(any(q is p for q in model.parameters())
                                                     for p in module.parameters() if p.requires_grad)})
        yield model
    record["fsdp"][-1]["original_untouched"] = not any(isinstance(p, DTensor) for p in module.parameters()) \
        and "FSDP" not in type(module).__name__


training_run.train, distributed.sharded_base = _recording_train, _recording_sharded_base
code = cli.main()
if os.environ.get("TIGHTROPE_TEST_RECORD"):
    with open(f"{os.environ['TIGHTROPE_TEST_RECORD']}.rank{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(record, f)
sys.exit(code)
