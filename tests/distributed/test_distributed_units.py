"""training/distributed.py without starting processes: sharding arithmetic, the dataset's sharded batches, the
launch environment, option checks, resume rules, and the host's behaviour on ranks other than 0."""
import dataclasses

import pytest
import torch
from one_rank_group import one_rank_group

from tightrope import cli
from tightrope.memory.strategy import ShardingConfig, Strategy, StrategyError
from tightrope.nodes import host
from tightrope.training import distributed
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.distributed import (DistributedError, Parallel, check_batch_size, check_resume, shard_bounds,
                                            this_rank_part, torchrun_env)
from tightrope.training.train_config import ConfigError

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture
def rank1_of_2(monkeypatch):
    """Pretend this process is rank 1 of 2 (no process group: only what needs no collective)."""
    monkeypatch.setattr(distributed, "_current", Parallel(rank=1, world_size=2, local_rank=1))


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in TORCHRUN_VARS:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 8, 9])
def test_shard_bounds_cut_a_batch_into_contiguous_near_equal_parts(n, world):
    parts = [shard_bounds(n, rank, world) for rank in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_batch_size_must_divide_over_the_world(rank1_of_2):
    check_batch_size(4)
    with pytest.raises(ConfigError, match=r"batch_size=3 is not divisible by the world size 2"):
        check_batch_size(3)
    check_batch_size(3, Parallel())  # one process: anything goes


def _dataset(n=9):
    g = torch.Generator().manual_seed(0)
    return TrainingDataset.from_tensors([torch.randn(4, 2, 2, generator=g) for _ in range(n)],
                                        [torch.randn(3, 8, generator=g) for _ in range(n)],
                                        [torch.randn(5, generator=g) for _ in range(n)])


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_batches_are_the_parts_of_the_unsharded_ones(world):
    """9 items, batch 4: global batches of 4, 4 and 1 per epoch; the ranks' parts put back together are the global
    batch, also when resuming mid-epoch; a rank with no part gets a stand-in sample."""
    data = _dataset()
    for start in (0, 2, 4):
        whole = data.batches(4, seed=7, start_step=start)
        parts = [data.batches(4, seed=7, start_step=start, shard=(rank, world)) for rank in range(world)]
        for _ in range(6):
            batch = next(whole)
            got = [next(p) for p in parts]
            n = batch["latents"].shape[0]
            assert all(part["shard"][2] == n for part in got)
            kept = [part for part in got if part["shard"][1] > part["shard"][0]]
            for key in ("latents", "context", "pooled"):
                assert torch.equal(torch.cat([part[key] for part in kept]), batch[key])
            for part in got:
                if part["shard"][0] == part["shard"][1]:
                    assert part["latents"].shape[0] == 1


def test_this_rank_part_slices_global_draws_and_weights_by_share():
    noise, t = torch.arange(5.0)[:, None].expand(5, 3), torch.arange(5.0)
    (n0, t0), w0 = this_rank_part({"shard": (0, 3, 5)}, noise, t)
    (n1, t1), w1 = this_rank_part({"shard": (3, 5, 5)}, noise, t)
    assert t0.tolist() == [0, 1, 2] and t1.tolist() == [3, 4] and n1.shape == (2, 3) and w0 + w1 == 1
    (_, t_empty), w_empty = this_rank_part({"shard": (1, 1, 1)}, noise[:1], t[:1])
    assert t_empty.tolist() == [0] and w_empty == 0
    (n_all, _), w_all = this_rank_part({"latents": noise}, noise, t)
    assert n_all is noise and w_all == 1.0


def test_torchrun_environment():
    assert torchrun_env({}) is None
    assert torchrun_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == (3, 4, 1)
    with pytest.raises(DistributedError, match="RANK=4 with WORLD_SIZE=4"):
        torchrun_env({"WORLD_SIZE": "4", "RANK": "4"})
    with pytest.raises(DistributedError, match="incomplete torchrun environment"):
        torchrun_env({"WORLD_SIZE": "2"})


def test_without_torchrun_the_run_is_one_process_and_fsdp_is_refused(no_torchrun):
    with distributed.launched() as par:
        assert par == Parallel() and distributed.current() is par and not par.distributed and par.shard is None
    assert distributed.current() == Parallel()
    with pytest.raises(DistributedError, match="--fsdp shards the base model over the processes torchrun starts"):
        with distributed.launched(fsdp=True):
            pass


def test_cli_fsdp_without_torchrun_exits_2(tmp_path, no_torchrun, capsys):
    workflow = tmp_path / "w.json"
    workflow.write_text("{}")
    assert cli.main(["run", str(workflow), "--output-dir", str(tmp_path / "o"), "--fsdp"]) == 2
    assert "error: --fsdp shards the base model" in capsys.readouterr().err


def test_fsdp_maps_to_the_strategy_sharding_part(monkeypatch):
    """--fsdp (Parallel.fsdp) sets Strategy.sharding and gives the runtime the ranks' mesh; without --fsdp the
    strategy is what the node chose; a sharding strategy outside a process group, or with layer offload, is refused."""
    model = torch.nn.Linear(2, 2)
    assert distributed.prepare_ranks(model, Strategy.of(checkpoint="all"), torch.device("cpu")) == \
        (Strategy.of(checkpoint="all"), None)
    monkeypatch.setattr(distributed, "_current", Parallel(fsdp=True))
    with pytest.raises(DistributedError, match=r"Strategy.shard='fsdp' shards the base model over the processes "
                       r"torchrun starts: launch with `torchrun"):
        distributed.prepare_ranks(model, Strategy(), torch.device("cpu"))
    for strategy in (Strategy.of(offload_fraction=0.5), Strategy.of(offload_blocks=(1,))):
        with pytest.raises(StrategyError, match=r"Strategy.shard='fsdp' \(--fsdp\) does not work with layer offload"):
            distributed.prepare_ranks(model, strategy, torch.device("cpu"))
    kept = Strategy.of(checkpoint="all", activation_offload=True, compile="per_block", weight_dtype="bf16")
    with one_rank_group():
        strategy, mesh = distributed.prepare_ranks(model, kept, torch.device("cpu"))
        assert strategy == kept.replace(shard="fsdp") and mesh is not None and mesh.size() == 1
    assert distributed.launch_sharding() == ShardingConfig(mode="fsdp")


def test_resume_keeps_the_global_batch_whatever_the_world_size(rank1_of_2):
    check_resume({"world_size": 4, "global_batch_size": 8}, 8)
    assert distributed.resume_fields(8) == {"world_size": 2, "global_batch_size": 8}
    with pytest.raises(ConfigError, match="global batch_size of 8 .* this one 4"):
        check_resume({"world_size": 4, "global_batch_size": 8}, 4)


def test_buckets_group_same_device_and_dtype_up_to_a_size():
    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(100)]
    assert list(distributed._buckets(tensors, limit=80)) == [[0, 1], [2], [3]]


def test_single_process_collectives_are_no_ops():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert distributed.all_reduce_gradients([p], 1.5) == 1.5 and p.grad.tolist() == [2.0, 2.0, 2.0]
    distributed.broadcast_parameters([p])
    assert distributed.on_main_rank(lambda: "written") == "written"


def test_other_ranks_show_no_progress_and_share_the_run_folder(tmp_path, monkeypatch, rank1_of_2):
    scratch = tmp_path / "scratch"
    monkeypatch.setattr(distributed, "_current", dataclasses.replace(distributed.current(), scratch_dir=scratch))
    with cli.headless_host(str(tmp_path / "run"), resume=False):
        assert host.output_dir() == scratch and host.preview_dir()[0] == scratch  # private writes
        assert host.loras_dir() == host.run_dir() == tmp_path / "run"                # shared reads
        assert host.cache_dir() == tmp_path / "run" / ".tightrope_cache"
        report = host.progress_reporter(10)
        assert report(1, 10, 0.5) is None and not host.is_main()


def test_launched_sets_this_ranks_gpu_and_gives_the_previous_one_back(monkeypatch):
    """CPU simulation of a 2-GPU machine: rank 1 works on cuda:1 inside the block; after it (also after an error)
    the process's current GPU is the one it had, as a ComfyUI server or a script that goes on expects."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: current.__setitem__(0, index))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # a group exists: none is created
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # rank 0: no scratch folder
    monkeypatch.setenv("LOCAL_RANK", "1")
    with distributed.launched() as par:
        assert par.local_rank == 1 and current == [1]
    assert current == [0]
    with pytest.raises(RuntimeError, match="node failed"), distributed.launched():
        assert current == [1]
        raise RuntimeError("node failed")
    assert current == [0]


def test_a_group_made_before_tightrope_without_a_cpu_backend_is_refused_before_training(monkeypatch):
    """An NCCL-only group (stood in for by gloo on CUDA tensors only) refuses host tensors, e.g. the gradients of
    optimizer offload, after the first step's backward: the launch refuses it, naming the fix."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.distributed.init_process_group("cuda:gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            torch.distributed.all_reduce(torch.ones(3))  # what the first step would meet
        with pytest.raises(DistributedError, match=r"the process group initialised before tightrope has no backend "
                           r"for CPU tensors \(backend 'cuda:gloo'\); .*backend='cpu:gloo,cuda:nccl'"), \
                distributed.launched():
            pass
        assert torch.distributed.is_initialized()  # not ours: left as it was
    finally:
        torch.distributed.destroy_process_group()
    with one_rank_group(), distributed.launched() as par:  # a group with a CPU backend is used as it is
        assert par.world_size == 1


def test_a_sharded_dora_run_saves_every_step(tmp_path, monkeypatch):
    """--fsdp with DoRA and save_every: each periodic save reads the base weights of the model as given, not of its
    sharded copy (whose DTensor shards made the DoRA file's norms fail: 'mixed torch.Tensor and DTensor')."""
    from demo_setup import demo_session
    from safetensors import safe_open

    from tightrope.training.lora.layers import LoraSpec
    from tightrope.training.trainer import SaveTarget, train
    session = demo_session(tmp_path, strategy=Strategy.of(compute_dtype="fp32"))
    session = session.advanced(lora=LoraSpec(rank=4, targets="attention", algorithm="dora"))
    with one_rank_group():
        monkeypatch.setattr(distributed, "_current", Parallel(rank=0, world_size=1, fsdp=True))
        out = train(session, 2, device=torch.device("cpu"), save=SaveTarget(tmp_path / "loras", "x", 1))
    assert len(out.saved) == 2
    with safe_open(out.saved[-1], framework="pt") as f:
        assert any(k.endswith(".dora_scale") for k in f.keys())


def test_under_torchrun_the_nodes_input_checks_refuse_what_the_ranks_would(monkeypatch):
    """A batch the world size does not divide, and layer offload under --fsdp, were refused only when the Train node
    ran (after the models loaded and the dataset was encoded): the nodes' input checks, which run before any node,
    refuse them now."""
    from tightrope.nodes.strategy_node import TightropeMemoryStrategy
    from tightrope.nodes.train_node import TightropeTrain
    spec = TightropeMemoryStrategy.INPUT_TYPES()["required"]
    offload = {k: v[1]["default"] for k, v in spec.items()} | {"offload_fraction": 0.5}
    train = dict(batch_size=1, device="cpu", optimizer="adamw", filename_prefix="x")
    assert TightropeTrain.VALIDATE_INPUTS(**train) is True and TightropeMemoryStrategy.VALIDATE_INPUTS(**offload)
    monkeypatch.setattr(distributed, "_current", Parallel(rank=0, world_size=2, fsdp=True))
    assert "batch_size=1 is not divisible by the world size 2" in TightropeTrain.VALIDATE_INPUTS(**train)
    assert "Strategy.shard='fsdp' (--fsdp) does not work with layer offload (offload_fraction=0.5" in \
        TightropeMemoryStrategy.VALIDATE_INPUTS(**offload)
    assert TightropeTrain.VALIDATE_INPUTS(**train | {"batch_size": 4}) is True


def test_rank_0s_error_is_one_line_on_the_other_ranks(rank1_of_2, monkeypatch):
    """A file write on rank 0 that fails (a locked state file, say) is reported there; the other ranks stop with one
    line pointing to it, not a traceback of the broadcast that told them (which `tightrope run` prints for a bug)."""
    def broadcast(box, src):
        box[0] = ("error", "StateLockedError: the state file is in use by another run")
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    with pytest.raises(DistributedError, match=r"rank 0 failed \(StateLockedError: the state file is in use by "
                                               r"another run\), so rank 1 stops too: see rank 0's output"):
        distributed.on_main_rank(lambda: pytest.fail("rank 1 must not run it"))
    assert isinstance(DistributedError("x"), cli.user_error_types())  # printed without a traceback


def test_a_rank_whose_dataset_differs_from_rank_0s_stops_every_rank(rank1_of_2, monkeypatch, tmp_path):
    """Each rank reads its own copy of the dataset (a folder on each machine): one out of sync trained a silent mix
    of both. Every rank compares image count, buckets and captions with rank 0's before training."""
    from demo_setup import demo_session

    from tightrope.training.data.image_folder import DatasetError
    from tightrope.training.input_checks import check_same_data_on_every_rank
    dataset = demo_session(tmp_path).dataset
    gathered = {}

    def all_gather_object(values, value):
        values[:] = [gathered.get("rank 0", value), value]
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    check_same_data_on_every_rank(dataset)  # the same data on both ranks
    gathered["rank 0"] = (dataset.num_images + 4, "another")
    with pytest.raises(DatasetError, match=rf"rank 1's dataset \({dataset.num_images} images\) differs from rank 0's "
                                           rf"\({dataset.num_images + 4} images; .*copy it identically"):
        check_same_data_on_every_rank(dataset)


def test_torchrun_where_pytorch_has_no_nccl_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Windows: its CUDA builds of PyTorch have no NCCL, and the group tightrope made ('cpu:gloo,cuda:nccl') failed in
    init_process_group with RuntimeError "Distributed package doesn't have NCCL built in": a bug's traceback, exit 1.
    Now one line before anything runs, exit 2. (This CPU-only torch has no NCCL either; CUDA is faked available.)"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    for name, fake in (("device_count", lambda: 1), ("current_device", lambda: 0), ("set_device", lambda i: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    with pytest.raises(DistributedError, match=r"torchrun on CUDA GPUs needs NCCL, which this PyTorch build lacks"):
        with distributed.launched():
            pass
    assert not torch.distributed.is_initialized()
    workflow = tmp_path / "w.json"
    workflow.write_text('{"1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}}}')
    assert cli.main(["run", str(workflow), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: torchrun on CUDA GPUs needs NCCL") and "Traceback" not in err
