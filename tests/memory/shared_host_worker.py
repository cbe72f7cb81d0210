"""One rank of tests/memory/test_shared_host.py: builds the tiny Flux (seed from argv), joins a gloo group through a
file store, shares its frozen host weights with the other local rank, and reports what its parameters now view."""
import json
import os
import sys

import torch

from tightrope.memory.shared_host import SharedWeightsError, share_across_local_ranks, shared_mappings
from tightrope.training.models.reference_flux import Flux, FluxParams
from tightrope.demo.tiny_checkpoint import init_tiny_weights_


def mapping_inode(ptr: int) -> int | None:
    """The inode of the file mapped at address `ptr` in this process (/proc/self/maps), None if anonymous."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr < end:
                return int(fields[4]) or None
    return None


def main(rank: int, store: str, seed: int, out: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = init_tiny_weights_(Flux(FluxParams.tiny()), seed).requires_grad_(False)
    model.img_in.weight.requires_grad_(True)  # a trainable weight stays private
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    report = {"rank": rank}
    try:
        shared = share_across_local_ranks(model, local_rank=rank)
        report["path"], report["nbytes"] = shared.path, shared.nbytes
        report["shared_params"] = len(shared.params)
        report["again"] = share_across_local_ranks(model, local_rank=rank) is None
    except SharedWeightsError as e:
        report["error"] = str(e)
    named = dict(model.named_parameters())
    report["unchanged"] = all(torch.equal(before[n], p) for n, p in named.items())
    report["moved"] = sorted(n for n, p in named.items() if p.data_ptr() != ptrs[n])
    report["inodes"] = sorted({mapping_inode(p.data_ptr()) for n, p in named.items() if n in report["moved"]})
    report["mapped_spans"] = len(shared_mappings())
    report["frozen_bytes"] = sum(p.numel() * p.element_size() for p in named.values() if not p.requires_grad)
    report["trainable_private"] = mapping_inode(model.img_in.weight.data_ptr()) is None
    with open(out, "w") as f:
        json.dump(report, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])
