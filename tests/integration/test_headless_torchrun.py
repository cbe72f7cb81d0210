"""The same workflow on a ComfyUI MODEL (a tiny random Flux loaded by the core UNETLoader through `--comfyui`) in one
process, under `torchrun --nproc_per_node=2` (gloo, CPU), and under torchrun with `--fsdp`: each rank loads the model
through ComfyUI, only rank 0 writes, and the LoRA is the single-process one within the tolerances argued in
tests/distributed/test_torchrun.py (the same checks, reused: losses to 1e-6, first-step gradients to 1e-4 of their
largest element, first-step weights within what AdamW makes of those gradient differences, later weights exactly AdamW
replayed on the recorded gradients). The runs record through tests/distributed/torchrun_entry.py."""
import json
import subprocess
import sys

import pytest
from api_graph import Graph
from comfy_env import COMFYUI_DIR, REPO, tightrope_env
from safetensors.torch import load_file
from tiny_models import CHECKPOINTS

DISTRIBUTED = REPO / "tests" / "distributed"
sys.path.insert(0, str(DISTRIBUTED))
from test_torchrun import LEARNING_RATE, STEPS, _assert_same_lora, _assert_same_losses, _free_port  # noqa: E402


def workflow(checkpoint: str) -> dict:
    """4 (empty) latents, global batch 4: 2 per rank; fp32, no offload (FSDP owns the block weights)."""
    g = Graph()
    unet = g.add("UNETLoader", unet_name=checkpoint, weight_dtype="default")
    cond = g.add("TightropeDemoConditioning", model=[unet, 0], text="a red circle", tokens=8)
    latent = g.add("EmptySD3LatentImage", width=64, height=64, batch_size=4)
    dataset = g.add("TightropeDatasetFromLatents", latent=[latent, 0], conditioning=[cond, 0])
    lora = g.add("TightropeLoraSetup", rank=4, alpha=4.0, targets="attention_mlp")
    strategy = g.add("TightropeMemoryStrategy", compute_dtype="fp32", weight_dtype="fp32", offload_fraction=0.0)
    train = g.add("TightropeTrain", steps=STEPS, learning_rate=LEARNING_RATE, batch_size=4, device="cpu", seed=0,
                  filename_prefix="dist/checkpoint", model=[unet, 0], dataset=[dataset, 0], lora=[lora, 0],
                  strategy=[strategy, 0])
    g.add("TightropeSaveLora", session=[train, 0], filename_prefix="dist/lora")
    return g.nodes


def launch(python: str, tmp, name: str, workflow_path, models, nproc: int, *extra: str) -> dict:
    out, tmpdir, record = tmp / name, tmp / f"{name}.tmp", tmp / f"{name}.record"
    tmpdir.mkdir()
    env = {**tightrope_env(tmp), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir), "TIGHTROPE_TEST_RECORD": str(record)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [python]
    if nproc > 1:
        command += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                    f"--master_port={_free_port()}"]
    command += [str(DISTRIBUTED / "torchrun_entry.py"), "run", str(workflow_path), "--comfyui", COMFYUI_DIR,
                "--models-dir", str(models), "--output-dir", str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    records = {}
    for rank in range(nproc):
        records[rank] = json.loads(open(f"{record}.rank{rank}").read())
        records[rank]["grads"] = load_file(f"{record}.rank{rank}.grads.safetensors")
    return {"out": out, "records": records, "process": done, "tmpdir": tmpdir}


@pytest.fixture(scope="module")
def runs(comfyui_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("headless_torchrun")
    name, write, _dtype = CHECKPOINTS["flux"]
    models = tmp / "models"
    write(models / "diffusion_models" / name)
    path = tmp / "workflow.json"
    path.write_text(json.dumps(workflow(name)))
    return {"single": launch(comfyui_python, tmp, "single", path, models, 1),
            "dp": launch(comfyui_python, tmp, "dp", path, models, 2),
            "fsdp": launch(comfyui_python, tmp, "fsdp", path, models, 2, "--fsdp")}


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_two_processes_train_the_single_process_lora(runs, kind):
    for rank in (0, 1):  # every rank reports the global-batch loss
        _assert_same_losses(runs[kind]["records"][rank]["losses"], runs["single"]["records"][0]["losses"])
    _assert_same_lora(runs[kind], runs["single"])


def test_only_rank_0_writes(runs):
    dp = runs["dp"]
    written = sorted(p.relative_to(dp["out"]).as_posix() for p in dp["out"].rglob("*")
                     if p.is_file() and ".tightrope_cache" not in p.parts)
    assert written == [".tightrope_state/dist/checkpoint.node-7.state.safetensors",  # the finished node's state
                       ".tightrope_state/dist/checkpoint.node-7.state.safetensors.lock", "dist/lora_00001_.safetensors"]
    assert not list(dp["tmpdir"].glob("tightrope-rank*"))  # rank 1's scratch output folder is gone
    assert dp["process"].stdout.count("ran 8 node(s)") == 1
