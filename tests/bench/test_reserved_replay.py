"""The headline step replayed through the allocator model (bench/reserved_replay.py): a block of a kind already run
replays the first one's script; that must give the allocator exactly the sequence that running every block gives."""
import json
import re

import pytest
import torch

from tightrope.bench.grid import strategy_label
from tightrope.bench.models import _meta_model
from tightrope.bench.reserved_replay import replay_step
from tightrope.memory.blocks import discover_blocks
from tightrope.memory.memory_model import measure_weight_sizes, predict_slot_bytes
from tightrope.memory.strategy import Strategy

BASE = Strategy.of(compute_dtype="bf16", checkpoint="all", activation_offload=True, offload_fraction=1.0,
                   prefetch_depth=0)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("expandable", [False, True])
def test_replayed_blocks_give_the_allocator_the_sequence_that_running_every_block_gives(chunks, expandable):
    runs = {}
    for full in (True, False):
        history: list = []
        result = replay_step(BASE.replace(token_chunks=chunks), "tiny", 256, expandable_segments=expandable,
                             full=full, history=history)
        runs[full] = result, history
    (ran, ran_history), (replayed, replayed_history) = runs[True], runs[False]
    # the same requests placed alike: (allocated, reserved) after each malloc; between two mallocs the same frees (in
    # any order: tensors that die together, e.g. with an autograd graph, die in an order of no meaning, and the
    # allocator's state after a batch of frees does not depend on it: merging free neighbours is associative)
    assert _mallocs(replayed_history) == _mallocs(ran_history)
    assert _frees_between_mallocs(replayed_history) == _frees_between_mallocs(ran_history)
    assert replayed == ran
    assert len(ran_history) > 1000          # two steps of 4 blocks: a real sequence, not a stub


def _mallocs(history):
    return [e for e in history if e[0] == "malloc"]


def _frees_between_mallocs(history):
    batches, batch = [], []
    for e in history:
        if e[0] == "malloc":
            batches.append(sorted(batch))
            batch = []
        else:
            batch.append(e[1])
    return batches + [sorted(batch)]


def test_the_replay_counts_what_exists_before_the_step_and_peaks_above_it():
    result = replay_step(BASE, "tiny", 256, steps=1)
    model = _meta_model("tiny", torch.bfloat16)
    blocks = discover_blocks(model)
    sizes = measure_weight_sizes(model, [b.module for b in blocks], None)
    inside = {id(p) for b in blocks for p in b.module.parameters()}
    outside = sum(p.numel() * 2 for p in model.parameters() if id(p) not in inside and not p.requires_grad)
    lora = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)  # fp32 in training
    slots = predict_slot_bytes(sizes, list(range(len(blocks))), 0)
    # each weight tensor is one request rounded up to 512 bytes; plus vec and the RoPE table
    assert result.persistent >= outside + lora + slots
    assert result.persistent <= outside + lora + slots + 512 * (len(list(model.parameters())) + 3) + (1 << 20)
    # a step's activations and AdamW state come on top
    assert result.peak_allocated > result.persistent + 2 * lora
    assert result.peak_reserved >= result.peak_allocated


def test_optimizer_offload_replays_without_the_adamw_state_on_the_device():
    """Under optimizer offload the step makes the same allocations in the same order less AdamW's moments and
    denominators, and frees each LoRA gradient no later: at every point of the second step (the first's moments are
    alive throughout it without offload) it holds at most what the step without holds, less the two moments."""
    off = replay_step(BASE, "tiny", 256)
    on = replay_step(BASE.replace(optimizer_offload=True), "tiny", 256)
    model = _meta_model("tiny", torch.bfloat16)
    moments = 2 * sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters() if p.requires_grad)  # fp32, 512 B
    assert on.persistent == off.persistent and on.peak_allocated <= off.peak_allocated - moments


def test_chunks_lower_the_replayed_peak_of_the_flux_dev_shape():
    """The headline shape at 1024 px (the ops are those of 2048 px; only sizes scale): token chunks cut
    the block's working set, so the replayed allocated and reserved peaks fall."""
    plain = replay_step(BASE, "flux-dev", 1024, steps=1)
    chunked = replay_step(BASE.replace(token_chunks=4), "flux-dev", 1024, steps=1)
    assert chunked.peak_allocated < plain.peak_allocated
    assert chunked.peak_reserved < plain.peak_reserved


def test_the_report_compares_with_the_measured_run_and_adds_the_residual_to_the_rest(tmp_path, monkeypatch,
                                                                                      capsys):
    """A measured folder in gpu-check's format for the tiny model at 256 px: the configuration it ran gets its
    measured columns and residual; one it did not run gets the replay plus the largest residual of that allocator."""
    from tightrope.bench import reserved_report
    from tightrope.bench.cli import main as bench_main

    ran, other = BASE, BASE.replace(prefetch_depth=1)
    replayed = replay_step(ran, "tiny", 256)
    residual = 3 << 20
    config = {"strategy": ran.to_flat(), "peak_allocated_bytes": replayed.peak_allocated,
              "peak_reserved_bytes": replayed.peak_reserved + residual, "oom": False}
    (tmp_path / reserved_report.RUNS[True]).write_text(json.dumps(
        {"sections": {"headline": {"model": "tiny", "resolution": 256, "batch": 1, "configs": [config]}}}))
    found = reserved_report.rows("tiny", 256, tmp_path, strategies=[ran, other])
    assert [(r["expandable"], r["measured"] is not None) for r in found] == \
        [(True, True), (True, False), (False, False), (False, False)]  # the default allocator's file is absent
    assert (found[0]["replay_allocated"], found[0]["replay_reserved"]) == (replayed.peak_allocated,
                                                                         replayed.peak_reserved)
    text = reserved_report.report(found, "tiny", 256, tmp_path)
    assert f"| expandable | `{strategy_label(ran)}` |" in text and "| +0.00 GiB |" in text  # 3 MiB
    assert f"`{strategy_label(other)}` (expandable allocator): " \
        f"{(found[1]['replay_reserved'] + residual) / 2**30:.2f} GiB" in text
    assert "(default allocator)" not in text  # nothing measured with it: no residual to add
    nothing = reserved_report.report([dict(r, measured=None) for r in found], "tiny", 256, tmp_path)
    assert "Not yet measured" not in nothing and "Nothing measured to compare with" in nothing
    # the command line: rows once, the report printed and written
    asked = []
    monkeypatch.setattr(reserved_report, "rows", lambda *a, **k: asked.append(a) or found)
    out = tmp_path / "reserved.md"
    assert bench_main(["reserved-replay", "--model", "tiny", "--resolution", "256", "--measured", str(tmp_path),
                       "--out", str(out)]) == 0
    assert asked == [("tiny", 256, tmp_path)]
    assert capsys.readouterr().out == out.read_text()
    assert "Command: `tightrope bench reserved-replay --model tiny --resolution 256`" in out.read_text()
    assert f"Measured: the GPU run in `{tmp_path.name}`" in out.read_text()


def test_out_may_name_a_folder_and_bad_paths_fail_before_the_replay(tmp_path, monkeypatch, capsys):
    """--out DIR, as the other benchmarks take it, writes reserved_replay.md there; a file in a missing folder, or a
    --measured folder that does not exist, is an argument error naming the fix, before any replay (no traceback)."""
    from tightrope.bench import reserved_report
    from tightrope.bench.cli import main as bench_main

    asked = []
    monkeypatch.setattr(reserved_report, "rows", lambda *a, **k: asked.append(a) or [])
    args = ["reserved-replay", "--model", "tiny", "--resolution", "256", "--measured", str(tmp_path)]
    assert bench_main(args + ["--out", str(tmp_path)]) == 0
    assert (tmp_path / "reserved_replay.md").read_text() == capsys.readouterr().out and len(asked) == 1
    for bad, message in ((["--out", str(tmp_path / "missing" / "r.md")],
                          rf"--out {tmp_path}/missing/r.md: the folder {tmp_path}/missing does not exist; create it, "
                          r"or name a file in an existing folder"),
                         (["--measured", str(tmp_path / "nowhere")],
                          rf"--measured {tmp_path}/nowhere: no such folder; name a gpu-check results folder")):
        with pytest.raises(SystemExit) as exit_:
            bench_main(args + bad)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err
        assert re.search(message, err), err
    assert len(asked) == 1
