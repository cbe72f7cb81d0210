"""Acceptance: the same workflow under torchrun (2 CPU processes, gloo) as in one process.

Tolerances, argued (not fitted). The 2-process run sums two half-batch gradients where one process reduces the whole
batch, so fp32 gradients differ in the last bits, and everything after inherits that. The entry script records, at
every optimizer step, the LoRA weights and the gradients after the all-reduce (what the optimizer sees).
- Losses: 1e-6 relative (measured 9e-8; fp32 unit roundoff is 6e-8 and a loss is a mean of O(1) terms).
- First-step gradients (both runs start from the same LoRA, checked bit for bit): only the summation order differs,
  an error of about n * 2^-24 * sum|terms| (n the reduction length, a few hundred here); with cancellation that can
  exceed an element's own size, so the check is against the tensor's largest gradient: GRAD_RTOL = 1e-4 of it
  (measured 1.7e-6). A bug (a lost rank, a part counted twice, wrong noise) moves gradients by O(1) of it.
- Weights after the first step: AdamW moves w by lr * m/(sqrt(v) + eps). With eps = 1e-8 and LoRA gradients of
  ~1e-7 (lora_B starts at zero, so lora_A's first gradients are tiny) a last-bit gradient difference dg is
  amplified up to lr/eps, so the bound is |dw| <= lr * (1 + C/4) * max|dg| / eps plus one ulp of the weights:
  d(m/(r+eps))/dm <= 1/eps; |d(m/(r+eps))/dr| = |m|/(r+eps)^2 <= C/(4 eps) where |m| <= C r (Cauchy-Schwarz over
  Adam's averaging weights, C = 1 at step 1); |dm|, |dr| <= max|dg| (measured: dg 1.2e-8, dw 4.1e-6; one step of lr 1e-3
  moves a weight by up to 1e-3, so a fixed weight tolerance either fails on another machine or checks nothing).
  Later steps compound this, so instead of a loose bound on the final LoRA, each run's later weights must be exactly what AdamW makes of its recorded gradients (replayed
  here with plain torch.optim.AdamW), and the later losses must agree to 1e-6.
FSDP only all-gathers the exact weights: its forward and backward equal the unsharded ones bit for bit on CPU
(checked exactly in test_fsdp_composes_with_the_strategies).
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dist_workflow import workflow
from merge_lora import with_lora_file
from tightrope.demo.model import demo_model
from tightrope.training.lora.files import read_lora_file
from tightrope.training.optimizer import host_adamw

HERE = os.path.dirname(__file__)
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-4
STEPS, LEARNING_RATE = 3, 1e-3
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which training/optimizer.py uses


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
        if os.path.exists(f"{record}.rank{rank}.grads.safetensors"):  # written by torchrun_entry.py
            records[rank]["grads"] = load_file(f"{record}.rank{rank}.grads.safetensors")
    return {"out": out, "records": records, "process": done, "tmpdir": tmpdir,
            "seconds": time.monotonic() - started}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The small demo workflow (9 images, batch 4: batches of 4, 4 and 1, so one rank's part is empty; 2
    micro-batches per step) once in one process, once on 2 processes, once on 2 processes with --fsdp."""
    tmp = tmp_path_factory.mktemp("torchrun")
    for name, kwargs in (("layer_offload", {"offload_fraction": 0.5}), ("resident", {"offload_fraction": 0.0}),
                         ("optimizer_offload", {"offload_fraction": 0.5, "optimizer_offload": True})):
        graph = workflow(steps=STEPS, learning_rate=LEARNING_RATE, grad_accumulation=2, **kwargs)
        (tmp / f"{name}.json").write_text(json.dumps(graph))
    entry = "torchrun_entry.py"
    return {
        "single": _launch(tmp, "single", entry, ["run", str(tmp / "layer_offload.json"), "--output-dir", "{out}"], 1),
        "dp": _launch(tmp, "dp", entry, ["run", str(tmp / "layer_offload.json"), "--output-dir", "{out}"], 2),
        "fsdp": _launch(tmp, "fsdp", entry, ["run", str(tmp / "resident.json"), "--output-dir", "{out}", "--fsdp"],
                        2),
        "dp_host_optimizer": _launch(tmp, "dp_host_optimizer", entry,
                                     ["run", str(tmp / "optimizer_offload.json"), "--output-dir", "{out}"], 2),
    }


def _loras(out) -> list:
    return sorted(p for p in out.rglob("*.safetensors") if not {".tightrope_cache", ".tightrope_state"} & set(p.parts))


def _assert_same_losses(got, want):
    assert len(got) == len(want) == 1 and len(got[0]) == len(want[0]) == STEPS
    for a, b in zip(got[0], want[0]):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (got, want)


def _recorded(run, kind: str, step: int) -> list[torch.Tensor]:
    """Rank 0's recorded LoRA weights or gradients ('weight' / 'grad') at an optimizer step, in parameter order."""
    record = run["records"][0]["grads"]
    count = sum(1 for k in record if k.startswith(f"{kind}{step}."))
    return [record[f"{kind}{step}.{i}"] for i in range(count)]


def _assert_same_lora(run, reference_run):
    """Same start, first-step gradients equal up to rounding, first-step weights within what Adam makes of that, and
    every later step exactly what AdamW makes of the recorded gradients."""
    w0, want_w0 = _recorded(run, "weight", 0), _recorded(reference_run, "weight", 0)
    assert len(w0) == len(want_w0) > 0 and all(torch.equal(a, b) for a, b in zip(w0, want_w0))
    g0, want_g0 = _recorded(run, "grad", 0), _recorded(reference_run, "grad", 0)
    worst_dg = 0.0
    for i, (got, want) in enumerate(zip(g0, want_g0)):
        dg, scale = (got - want).abs().max().item(), want.abs().max().item()
        worst_dg = max(worst_dg, dg)
        assert dg <= GRAD_RTOL * scale, f"first-step gradient {i} differs by {dg}, its largest element is {scale}"
    w1, want_w1 = _recorded(run, "weight", 1), _recorded(reference_run, "weight", 1)
    bound = LEARNING_RATE * (1 + 1 / 4) * worst_dg / ADAM_EPS + max(w.abs().max().item() for w in want_w1) * 2**-23
    worst = max((a - b).abs().max().item() for a, b in zip(w1, want_w1))
    assert worst <= bound, (f"weights after step 1 differ by up to {worst}, more than the {bound} that first-step "
                            f"gradient differences of up to {worst_dg} allow")
    _assert_weights_follow_adamw(run)
    _assert_weights_follow_adamw(reference_run)
    (path,), (reference,) = _loras(run["out"]), _loras(reference_run["out"])
    (got, meta), (want, _) = read_lora_file(path), read_lora_file(reference)
    assert got.keys() == want.keys() and all(got[k].shape == want[k].shape for k in want)
    assert meta["tightrope.steps"] == str(STEPS)


def _assert_weights_follow_adamw(run):
    """Replay: AdamW as the trainer makes it on the CPU (the fused kernel, with and without optimizer offload) and
    gradient clipping at the workflow's max_grad_norm, 1.0, on the recorded gradients from the recorded first weights
    gives every recorded later weight bit for bit (same ops on the same CPU)."""
    params = [torch.nn.Parameter(w.clone()) for w in _recorded(run, "weight", 0)]
    optimizer = host_adamw(params, lr=LEARNING_RATE, weight_decay=0.0)
    for step in range(STEPS - 1):
        for p, g in zip(params, _recorded(run, "grad", step)):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        for i, (p, w) in enumerate(zip(params, _recorded(run, "weight", step + 1))):
            assert torch.equal(p.detach(), w), f"weight {i} after step {step + 1} is not AdamW's step"


def test_two_processes_train_what_one_process_trains(runs):
    single, dp = runs["single"], runs["dp"]
    for rank in (0, 1):  # every rank reports the global-batch loss
        _assert_same_losses(dp["records"][rank]["losses"], single["records"][0]["losses"])
    _assert_same_lora(dp, single)


def test_two_processes_with_the_optimizer_on_the_host_train_what_one_process_trains(runs):
    """Optimizer offload under data parallel: the host gradients are all-reduced (gloo, the CPU's backend) and the
    fused host AdamW steps them; the recorded gradients are the host ones (what that optimizer sees)."""
    single, dp = runs["single"], runs["dp_host_optimizer"]
    for rank in (0, 1):
        _assert_same_losses(dp["records"][rank]["losses"], single["records"][0]["losses"])
    _assert_same_lora(dp, single)


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
    _assert_same_lora(fsdp, single)
    (lora,) = _loras(fsdp["out"])
    # the saved LoRA loads into the reference model and changes what it predicts
    base = demo_model(0)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 4, 4, generator=g), torch.tensor([0.5])
    context, pooled = torch.randn(1, 8, base.flux.params.context_in_dim, generator=g), \
        torch.randn(1, base.flux.params.vec_in_dim, generator=g)
    with torch.no_grad():
        before = base.predict(base.flux, x, t, context, pooled, 1.0)
        merged = with_lora_file(base, lora)
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
