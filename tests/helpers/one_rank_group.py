"""A process group of one rank (gloo, in this process) and its device mesh, for in-process tests of sharding; torn
down on exit, also when the test fails. Runs of several ranks are in tests/distributed (torchrun)."""
import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh


@contextlib.contextmanager
def one_rank_group():
    assert not torch.distributed.is_initialized(), "a process group is already set up in this process"
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()
