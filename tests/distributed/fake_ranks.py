"""Several torchrun ranks in one process, one thread each, for fast tests of what the ranks must agree on.

`run_ranks(monkeypatch, world, fn)` runs fn(rank) on `world` threads; `distributed.current()` answers each thread
with its own rank, and torch.distributed's object collectives (broadcast_object_list, all_gather_object, the ones
training/distributed.py uses to agree) are exchanged between the threads, pickled as gloo would. A collective that
not every rank joins (the hang a real run would get) raises CollectiveHang on the ranks waiting in it.
A rank that has returned or raised leaves the group, as torchrun stops a job when one process ends.
"""
import pickle
import threading

import torch

from tightrope.training import distributed
from tightrope.training.distributed import Parallel


class CollectiveHang(RuntimeError):
    """A collective that not every rank joined: a real run would hang (or time out) there."""


class FakeGroup:
    def __init__(self, world: int, timeout: float = 60.0):
        self.world, self.timeout = world, timeout
        self.cond = threading.Condition()
        self.calls = [0] * world              # collectives each rank has entered
        self.sent: dict[int, list] = {}       # the n-th collective -> what each rank sent (pickled)
        self.left: set[int] = set()           # ranks that have returned or raised
        self.local = threading.local()

    def parallel(self) -> Parallel:
        rank = getattr(self.local, "rank", None)
        return Parallel() if rank is None else Parallel(rank=rank, world_size=self.world, local_rank=rank)

    def _exchange(self, value) -> list:
        rank = self.local.rank
        with self.cond:
            n = self.calls[rank]
            self.calls[rank] += 1
            sent = self.sent.setdefault(n, [None] * self.world)
            sent[rank] = pickle.dumps(value)
            self.cond.notify_all()
            gone = lambda: [q for q in self.left if self.calls[q] <= n]  # noqa: E731
            self.cond.wait_for(lambda: None not in sent or gone(), self.timeout)
            if None in sent:
                raise CollectiveHang(f"rank {rank} waits in collective #{n + 1} that rank(s) "
                                     f"{gone() or 'of the group'} never joined")
            return [pickle.loads(v) for v in sent]

    def leave(self, rank: int) -> None:
        with self.cond:
            self.left.add(rank)
            self.cond.notify_all()

    def broadcast_object_list(self, objects, src=0, group=None, device=None):
        objects[:] = self._exchange(list(objects) if self.local.rank == src else None)[src]

    def all_gather_object(self, object_list, obj, group=None):
        object_list[:] = self._exchange(obj)


def run_ranks(monkeypatch, world: int, fn) -> list[tuple[str, object]]:
    """fn(rank) on every rank: [("ok", its result) or ("error", its exception)] in rank order."""
    group = FakeGroup(world)
    monkeypatch.setattr(distributed, "current", group.parallel)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", group.broadcast_object_list)
    monkeypatch.setattr(torch.distributed, "all_gather_object", group.all_gather_object)
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        group.local.rank = rank
        try:
            results[rank] = ("ok", fn(rank))
        except BaseException as exc:  # noqa: BLE001 - the test reads what each rank raised
            results[rank] = ("error", exc)
        finally:
            group.leave(rank)  # a rank still waiting for this one would wait forever in a real run

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
