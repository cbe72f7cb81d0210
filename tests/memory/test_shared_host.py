"""Several ranks on one machine share one host copy of the frozen weights (memory/shared_host.py): two gloo ranks
(real processes, so the mapping is really shared) end with their frozen parameters viewing the same /dev/shm file,
values unchanged, nothing left in /dev/shm; ranks holding different models refuse, untouched, and clean up too."""
import glob
import json
import os
import subprocess
import sys

import pytest

from tightrope.memory.shared_host import PREFIX, SHM_DIR, SharedWeightsError, share_host_weights

WORKER = os.path.join(os.path.dirname(__file__), "shared_host_worker.py")
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm (Linux)")


def _ours() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, PREFIX + "*")))


def run_ranks(tmp_path, seeds: tuple[int, int]) -> list[dict]:
    before = _ours()
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), str(tmp_path / "store"), str(seed),
                               str(tmp_path / f"rank{rank}.json")], stderr=subprocess.PIPE, text=True)
             for rank, seed in enumerate(seeds)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    assert _ours() == before  # the file was unlinked, also after a refusal
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_two_local_ranks_map_one_copy_of_the_frozen_weights(tmp_path):
    r0, r1 = run_ranks(tmp_path, (0, 0))
    assert "error" not in r0 and "error" not in r1
    assert r0["path"] == r1["path"]
    # one file, the same inode in both processes, holding every frozen parameter (aligned to 256 bytes each)
    assert len(r0["inodes"]) == 1 and r0["inodes"] == r1["inodes"] and r0["inodes"][0] is not None
    assert r0["moved"] == r1["moved"] and len(r0["moved"]) == r0["shared_params"]
    assert r0["frozen_bytes"] <= r0["nbytes"] < r0["frozen_bytes"] + 256 * r0["shared_params"] + 256
    assert r0["trainable_private"] and r1["trainable_private"] and "img_in.weight" not in r0["moved"]
    assert r0["unchanged"] and r1["unchanged"]
    assert r0["again"] and r1["again"]  # a second run in the same processes finds nothing left to share
    assert r0["mapped_spans"] == r1["mapped_spans"] == 1


def test_ranks_with_different_weights_refuse_and_keep_their_own(tmp_path):
    r0, r1 = run_ranks(tmp_path, (0, 1))
    for r in (r0, r1):
        assert "local rank 1: a frozen weight of shape" in r["error"]
        assert "every rank must load the same base model" in r["error"]
        assert r["moved"] == [] and r["unchanged"] and r["mapped_spans"] == 0


def test_a_shm_folder_that_cannot_take_the_copy_is_an_error_not_a_crash(tmp_path):
    """Local rank 0's OSError (here a missing folder; a full /dev/shm is ENOSPC from posix_fallocate, before any
    page is written) is reported by every rank, and no parameter moves."""
    import torch
    model = torch.nn.Linear(4, 4).requires_grad_(False)
    weight = model.weight.data_ptr()
    with pytest.raises(SharedWeightsError, match="local rank 0 could not write .* to .*missing"):
        share_host_weights(model, local_rank=0, token="t", exchange=lambda x: [x, x],
                           folder=str(tmp_path / "missing"))
    assert model.weight.data_ptr() == weight


def test_a_shm_without_room_for_the_copy_leaves_every_rank_its_own_and_says_how_to_share(tmp_path, monkeypatch):
    """Docker's default /dev/shm is 64 MB: the run goes on with private copies (as before sharing existed) instead
    of failing on every rank, and the warning names the fix."""
    import torch

    from tightrope.memory import shared_host
    model = torch.nn.Linear(64, 64).requires_grad_(False)
    weight = model.weight.data_ptr()
    monkeypatch.setattr(shared_host, "_free_bytes", lambda folder: 64 * 64 * 4)  # less than the copy and its margin
    with pytest.warns(RuntimeWarning, match=r"has 0.00 GiB free and one host copy of the frozen weights needs "
                                            r"0.00 GiB: every rank keeps its own copy in host RAM; .*--shm-size"):
        assert share_host_weights(model, local_rank=0, token="t", exchange=lambda x: [x, x],
                                  folder=str(tmp_path)) is None
    assert model.weight.data_ptr() == weight and not list(tmp_path.iterdir())


def test_a_file_left_by_a_killed_run_is_removed_by_the_next_one(tmp_path):
    """A rank killed (SIGKILL) while the ranks share their weights leaves its /dev/shm file: tmpfs memory held until
    reboot. The next run's local rank 0 removes such files (they live seconds when all goes well), and says so;
    a file of a run sharing right now is left alone."""
    import time

    import torch

    from tightrope.memory import shared_host
    stale, live, other = (tmp_path / f"{PREFIX}old", tmp_path / f"{PREFIX}now", tmp_path / "someone-elses")
    for path in (stale, live, other):
        path.write_bytes(bytes(4096))
    hour_ago = time.time() - shared_host.STALE_AFTER_S - 1
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(other, (hour_ago, hour_ago))
    model = torch.nn.Linear(4, 4)  # nothing frozen: nothing to share, the sweep still runs
    with pytest.warns(RuntimeWarning, match=r"removed .*tightrope-weights-old \(0.00 GiB of shared memory\), left "
                                            r"by a run that was killed while its ranks shared their weights"):
        assert share_host_weights(model, local_rank=0, token="t", exchange=lambda x: [x, x],
                                  folder=str(tmp_path)) is None
    assert not stale.exists() and live.exists() and other.exists()
