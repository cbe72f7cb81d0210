"""Under torchrun every rank runs the whole workflow; they must all run the same one, with the same options."""
from __future__ import annotations

import hashlib
import json

from ..training import distributed  # its current(), looked up at call time (tests fake the ranks)
from .graph import WorkflowError
from .workflow_format import to_api_prompt


def check_same_run_on_every_rank(graph, resume: bool) -> None:
    """Under torchrun, before any node runs: every rank must run the same workflow with the same --resume and --fsdp.
    A rank with another copy of the workflow (another machine's older file: other steps, another learning rate) or
    other options would wait in collectives the others never join (a hang until the process group's 30-minute
    timeout: steps 6 on rank 1, 4 on rank 0) or silently train other weights than rank 0 saves
    (another learning_rate). Every rank stops with one line naming the ranks that differ. The output dir may differ
    (machines mount a shared folder at other paths). Node titles do not count."""
    par = distributed.current()
    if not par.distributed:
        return
    nodes = {node_id: {k: v for k, v in node.items() if k != "_meta"} for node_id, node in to_api_prompt(graph).items()}
    mine = {"workflow": hashlib.sha256(json.dumps(nodes, sort_keys=True, default=repr).encode()).hexdigest(),
            "--resume": resume, "--fsdp": par.fsdp}
    runs = distributed.from_every_rank(mine)
    differ = [(rank, [k for k in mine if run[k] != runs[0][k]]) for rank, run in enumerate(runs) if run != runs[0]]
    if differ:
        shown = "; ".join(f"rank {rank}: {', '.join('another workflow' if k == 'workflow' else k for k in keys)}"
                          for rank, keys in differ)
        raise WorkflowError(f"the ranks do not run the same workflow with the same options as rank 0 ({shown}): "
                            "every rank must run the same workflow file with the same --resume and --fsdp (on "
                            "several machines, copy the same file to each or put it on a shared file system); "
                            "nothing was run")
