"""One rank failing under torchrun, seen from the others: a peer that went away is one line naming this rank and the
collective (not gloo's traceback, which read like a bug of the surviving rank), and ranks that run another workflow
or other options are stopped before any node runs (they hung in mismatched collectives or trained other weights)."""
import json

import pytest
import torch
from dist_workflow import workflow
from fake_ranks import run_ranks

from tightrope import NODE_CLASS_MAPPINGS, cli
from tightrope.headless.graph import WorkflowError
from tightrope.headless.same_run import check_same_run_on_every_rank
from tightrope.headless.workflow_format import load_workflow
from tightrope.training import distributed
from tightrope.training.distributed import Parallel
from tightrope.training.rank_lost import RankLostError

GLOO_PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:4333. This is typically caused by a remote worker crashing. Check the logs of the "
                  "remote worker before reporting an error. GLHF! \N{UMBRELLA ON GROUND}")


@pytest.fixture
def rank0_of_2(monkeypatch):
    monkeypatch.setattr(distributed, "_current", Parallel(rank=0, world_size=2, local_rank=0))


def _peer_gone(*args, **kwargs):
    raise RuntimeError(GLOO_PEER_GONE)


def test_a_peer_gone_in_the_gradient_all_reduce_is_one_line(rank0_of_2, monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", _peer_gone)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RankLostError) as info:
        distributed.all_reduce_gradients([p], 1.0)
    message = str(info.value)
    assert "rank 0 lost another rank during the gradient all-reduce" in message
    assert "Connection closed by peer [127.0.0.1]:4333" in message and "GLHF" not in message
    assert isinstance(info.value.__cause__, RuntimeError)  # --debug shows gloo's own traceback
    # exit 1, no traceback
    assert RankLostError in cli.user_error_types() and RankLostError not in cli.bad_input_types()


@pytest.mark.parametrize("collective", ["broadcast_object_list", "all_gather_object"])
def test_a_peer_gone_while_the_ranks_agree_is_one_line(rank0_of_2, monkeypatch, collective):
    monkeypatch.setattr(torch.distributed, collective, _peer_gone)
    with pytest.raises(RankLostError, match="rank 0 lost another rank during an exchange"):
        distributed.on_every_rank(lambda: 1) if collective == "all_gather_object" else distributed.on_main_rank(
            lambda: 1)


def test_other_collective_errors_stay_what_they_were(rank0_of_2, monkeypatch):
    """Only a peer that went away is reworded: anything else from a collective (a bug: wrong dtype, a mismatch) keeps
    its own type and traceback."""
    def bad(*a, **k):
        raise RuntimeError("Tensors must be contiguous")
    monkeypatch.setattr(torch.distributed, "all_reduce", bad)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="contiguous") as info:
        distributed.all_reduce_gradients([p], 1.0)
    assert not isinstance(info.value, RankLostError)


def _graph(**kwargs):
    return load_workflow(workflow(**kwargs), NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("rank1, expected", [
    ({"kwargs": {"steps": 6}}, "rank 1: another workflow"),             # hung in mismatched collectives before
    ({"kwargs": {"learning_rate": 2e-3}}, "rank 1: another workflow"),  # trained other weights silently before
    ({"resume": True}, "rank 1: --resume"),                             # mixed collectives, wrong messages before
])
def test_ranks_running_another_workflow_or_options_stop_before_any_node(monkeypatch, rank1, expected):
    def rank_main(rank):
        mine = rank1 if rank == 1 else {}
        check_same_run_on_every_rank(_graph(**mine.get("kwargs", {})), mine.get("resume", False))
    results = run_ranks(monkeypatch, 2, rank_main)
    for kind, error in results:
        assert kind == "error" and isinstance(error, WorkflowError), results
        assert expected in str(error) and "nothing was run" in str(error)


def test_ranks_running_the_same_workflow_go_on(monkeypatch):
    graphs = [_graph(), load_workflow(json.loads(json.dumps(workflow())), NODE_CLASS_MAPPINGS)]
    graphs[1]["7"].title = "a title of its own"  # titles do not count
    results = run_ranks(monkeypatch, 2, lambda rank: check_same_run_on_every_rank(graphs[rank], True))
    assert results == [("ok", None), ("ok", None)]
