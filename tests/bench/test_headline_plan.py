"""`tightrope bench headline-plan`: the headline's predicted peak from shapes, and the configuration `make gpu-check`
must measure because the planner would pick it for the smallest budget."""
import pytest

from tightrope.bench.cli import main as bench_main
from tightrope.bench.gpu_check import headline_configs
from tightrope.bench.headline_plan import HEADLINE_BUDGET, headline_profile, least_peak
from tightrope.memory.plan_cost import predict
from tightrope.memory.probe import TOKEN_CHUNKS
from tightrope.memory.strategy import Strategy

GiB = 2 ** 30


def test_gpu_check_measures_the_planners_least_peak_configuration():
    profile, shapes = headline_profile()
    strategy, prediction = least_peak(profile, optimizer_offload=False)
    assert strategy in [c.strategy for c in headline_configs("cuda", 2048, 1)]
    assert (strategy.offload.fraction, strategy.offload.prefetch_depth, strategy.checkpointing.mode,
            strategy.activations.enabled, strategy.checkpointing.token_chunks) == \
        (1.0, 0, "all", True, TOKEN_CHUNKS)
    # the breakdown adds up, and the slots are one cell: the largest block as packed
    b = prediction.breakdown
    assert b["slots"] == max(profile.block_packed) and b["weights"] > b["slots"]
    parts = b["weights"] + b["gradients"] + b["optimizer"] + b["activations"] + b["transient"] + b["margin"]
    assert abs(parts - prediction.peak_bytes) <= 8
    # at 2048 px one single block's own forward + backward is more than 3 GiB, as 4x the tokens of 1024 px make it
    # (activations grow with the tokens; attention is flash-like, linear in them); in token chunks it falls below
    # 1.5 GiB (attention's q, k, v, output and their gradients are what is left whole), and the largest part left is
    # no longer that transient alone
    assert shapes["SingleStreamBlock"].peak > 3 * GiB
    assert shapes[f"SingleStreamBlock, {TOKEN_CHUNKS} token chunks"].peak < 1.5 * GiB
    unchunked = predict(profile, strategy.replace(token_chunks=1))
    assert unchunked.breakdown["transient"] > unchunked.breakdown["weights"] + unchunked.breakdown["activations"]
    assert unchunked.peak_bytes - prediction.peak_bytes > 2 * GiB
    deeper = predict(profile, strategy.replace(prefetch_depth=1))
    assert deeper.breakdown["slots"] == 2 * b["slots"] and deeper.peak_bytes > prediction.peak_bytes
    # the forward a checkpointed chunked block reruns in backward skips its output chunks (output projection, MLP,
    # residual): what is left is the q, k, v projection, 6 of a Flux block's 24 h^2 matmul FLOPs per token (+ LoRA;
    # attention is not counted on fake tensors), a quarter of the chunked forward
    for c in profile.chunked:
        assert 0.22 * c.fwd_s < c.recompute_s < 0.3 * c.fwd_s
    # with optimizer offload among the candidates the least peak is the same configuration with it: the LoRA's
    # gradients (all but two blocks' in flight; the LoRA is in the blocks alone) and AdamW's two moments leave the
    # device, margin included
    offloaded, least = least_peak(profile)
    assert offloaded == strategy.replace(optimizer_offload=True)
    assert sum(profile.block_trainable) == profile.trainable_bytes
    saved = profile.trainable_bytes - 2 * max(profile.block_trainable) + 8 * profile.trainable_numel
    assert abs(prediction.peak_bytes - least.peak_bytes - 1.05 * saved) <= 8


def test_the_command_prints_and_writes_the_breakdown(tmp_path, capsys):
    out = tmp_path / "headline_plan.md"
    assert bench_main(["headline-plan", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == out.read_text()
    assert "Command: `tightrope bench headline-plan`" in text and f"{HEADLINE_BUDGET / 1e9:g} GB budget" in text
    for what in ("offload 0.9", "offload 1.0", f"offload 1.0 + {TOKEN_CHUNKS} token chunks",
                 "of which offload slots", "AdamW state", "largest block transient", "| PEAK |",
                 f"SingleStreamBlock, {TOKEN_CHUNKS} token chunks", "## Largest batch that fits, 1024 px\n",
                 "| 24 GB | "):
        assert what in text
    # the planner finds a plan at 4 GB (predicted from shapes; the allocator's gap is a GPU's to measure), in token
    # chunks, and gpu-check measures it; with optimizer offload allowed it finds one at least as fast by the model
    # (it takes optimizer offload where the device memory that frees buys a deeper prefetch), and where it takes it
    # the breakdown shows its host memory
    assert "No plan" not in text and "optimizer offload allowed" in text
    off, allowed = (Strategy.from_json(part.split("`")[0]) for part in text.split("Strategy: `")[1:3])
    assert off.checkpointing.token_chunks == TOKEN_CHUNKS and not off.optimizer.enabled
    assert off in [c.strategy for c in headline_configs("cuda", 2048, 1)]
    assert allowed in [c.strategy for c in headline_configs("cuda", 2048, 1)]
    seconds = [float(part.split(" s/step")[0].rsplit("~", 1)[1]) for part in text.split("Predicted ")[1:3]]
    assert seconds[1] <= seconds[0]
    if allowed.optimizer.enabled:
        assert "the LoRA's optimizer state and gradients wait in host memory" in text
        assert "| host memory: the LoRA, its gradients and AdamW state (optimizer offload) |" in text
    else:
        assert allowed == off


def test_out_may_name_a_folder_and_a_missing_folder_fails_at_once(tmp_path, monkeypatch, capsys):
    from tightrope.bench import headline_plan
    monkeypatch.setattr(headline_plan, "report", lambda *a: "plan\n")
    monkeypatch.setattr(headline_plan, "largest_batch_section", lambda: "batches\n")
    assert bench_main(["headline-plan", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "headline_plan.md").read_text() == capsys.readouterr().out == "plan\n\nbatches\n"
    monkeypatch.setattr(headline_plan, "report", lambda *a: pytest.fail("planned before checking --out"))
    with pytest.raises(SystemExit) as exit_:
        bench_main(["headline-plan", "--out", str(tmp_path / "missing" / "h.md")])
    assert exit_.value.code == 2 and "the folder" in capsys.readouterr().err
