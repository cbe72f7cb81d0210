"""Acceptance: the same workflow under torchrun (2 CPU processes, gloo) as in one process.

Tolerances: the 2-process run sums two half-batch gradients where one process reduces the whole batch, so fp32
results differ in the last bits. Losses: 1e-6 relative (measured 9e-8). LoRA weights: Adam divides by the gradient's
running RMS, so a last-bit difference in a near-zero gradient can move a weight by a visible fraction of one step
(lr); we allow 1/1000 of the most Adam can move a weight in the run, 1e-3 * lr * steps = 3e-6 absolute (measured
4e-7, weights up to 0.09). FSDP only all-gathers the exact weights: its forward and backward equal the unsharded
ones bit for bit on CPU (checked exactly in test_fsdp_composes_with_the_strategies).
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from dist_workflow import workflow
from tightrope.training.demo import demo_model
from tightrope.training.lora_file import read_lora_file

HERE = os.path.dirname(__file__)
LOSS_RTOL = 1e-6
STEPS, LEARNING_RATE = 3, 1e-3
LORA_ATOL = 1e-3 * LEARNING_RATE * STEPS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp, name: str, script: str, args: list[str], nproc: int) -> dict:
    """Run `script` (one process, or `nproc` under torchrun); returns the output dir, the records of all ranks
    and the completed process. TMPDIR is private so the test can see the ranks' scratch folders go away."""
    out, tmpdir, record = tmp / name, tmp / f"{name}.tmp", tmp / f"{name}.record"
    tmpdir.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmpdir), TIGHTROPE_TEST_RECORD=str(record),
               PYTHONWARNINGS="ignore")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable]
    if nproc > 1:
        command += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                    f"--master_port={_free_port()}"]
    command += [os.path.join(HERE, script)] + [a.replace("{out}", str(out)) for a in args]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    records = {}
    for rank in range(nproc):
        with open(f"{record}.rank{rank}") as f:
            records[rank] = json.load(f)
    return {"out": out, "records": records, "process": done, "tmpdir": tmpdir,
            "seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The small demo workflow (9 images, batch 4: batches of 4, 4 and 1, so one rank's part is empty; 2
    micro-batches per step) once in one process, once on 2 processes, once on 2 processes with --fsdp."""
    tmp = tmp_path_factory.mktemp("torchrun")
    for name, kwargs in (("layer_offload", {"offload_fraction": 0.5}), ("resident", {"offload_fraction": 0.0})):
        graph = workflow(steps=STEPS, learning_rate=LEARNING_RATE, grad_accumulation=2, **kwargs)
        (tmp / f"{name}.json").write_text(json.dumps(graph))
    entry = "torchrun_entry.py"
    return {
        "single": _launch(tmp, "single", entry, ["run", str(tmp / "layer_offload.json"), "--output-dir", "{out}"], 1),
        "dp": _launch(tmp, "dp", entry, ["run", str(tmp / "layer_offload.json"), "--output-dir", "{out}"], 2),
        "fsdp": _launch(tmp, "fsdp", entry, ["run", str(tmp / "resident.json"), "--output-dir", "{out}", "--fsdp"],
                        2),
    }


def _loras(out) -> list:
    return sorted(p for p in out.rglob("*.safetensors") if not {".tightrope_cache", ".tightrope_state"} & set(p.parts))


def _assert_same_losses(got, want):
    assert len(got) == len(want) == 1 and len(got[0]) == len(want[0]) == STEPS
    for a, b in zip(got[0], want[0]):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (got, want)


def _assert_same_lora(path, reference):
    (got, meta), (want, _) = read_lora_file(path), read_lora_file(reference)
    assert got.keys() == want.keys() and all(got[k].shape == want[k].shape for k in want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= LORA_ATOL, f"LoRA weights differ by up to {worst}"
    assert meta["tightrope.steps"] == str(STEPS)


def test_two_processes_train_what_one_process_trains(runs):
    single, dp = runs["single"], runs["dp"]
    for rank in (0, 1):  # every rank reports the global-batch loss
        _assert_same_losses(dp["records"][rank]["losses"], single["records"][0]["losses"])
    (reference,), (lora,) = _loras(single["out"]), _loras(dp["out"])
    _assert_same_lora(lora, reference)


def test_only_rank_0_writes_and_reports(runs):
    dp = runs["dp"]
    names = sorted(p.relative_to(dp["out"]).as_posix() for p in dp["out"].rglob("*")
                   if p.is_file() and ".tightrope_cache" not in p.parts and "images" not in p.parts)
    state = ".tightrope_state/dist/lora_checkpoint.node-7.state.safetensors"  # written by rank 0, locked while training
    assert names == [state, state + ".lock", "dist/lora_00001_.safetensors", "dist/plot_loss_00001_.png",
                     "dist/plot_memory_00001_.png"]
    assert not list(dp["tmpdir"].glob("tightrope-rank*"))  # the other rank's scratch output folder is gone
    output = dp["process"].stdout
    assert output.count("ran 9 node(s)") == 1 and output.count("TightropeSaveLora") == 1


def test_fsdp_shards_the_base_and_trains_the_same_lora(runs):
    fsdp, single = runs["fsdp"], runs["single"]
    for rank in (0, 1):
        (info,) = fsdp["records"][rank]["fsdp"]
        assert info["sharded_tensors"] > 0 and info["local_numel"] * 2 == info["global_numel"]  # half per rank
        assert info["lora_is_shared"] and info["original_untouched"]
        _assert_same_losses(fsdp["records"][rank]["losses"], single["records"][0]["losses"])
    (lora,) = _loras(fsdp["out"])
    _assert_same_lora(lora, _loras(single["out"])[0])
    # the saved LoRA loads into the reference model and changes what it predicts
    base = demo_model(0)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 4, 4, generator=g), torch.tensor([0.5])
    context, pooled = torch.randn(1, 8, base.flux.params.context_in_dim, generator=g), \
        torch.randn(1, base.flux.params.vec_in_dim, generator=g)
    with torch.no_grad():
        before = base.predict(base.flux, x, t, context, pooled, 1.0)
        merged = base.with_lora(str(lora))
        after = merged.predict(merged.flux, x, t, context, pooled, 1.0)
    assert (after - before).abs().max() > 1e-6


def test_fsdp_composes_with_the_strategies(tmp_path):
    run = _launch(tmp_path, "strategies", "fsdp_strategies_entry.py", [], 2)
    for rank in (0, 1):
        record = run["records"][rank]
        assert record.pop("model_unchanged")
        for name, r in record.items():
            assert r["sharded_tensors"] > 0, name
            assert r["losses"][0] == r["losses"][1] and r["grad_max_diff"] == 0.0 and r["grad_max"] > 0, (name, r)
