"""Token chunks in the profile, the cost model and the planner: chunked figures replace a block's own only where
the block was measured chunked, the planner proposes chunks only for a model that has them, and picks them when
nothing else fits."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tiny_flux import tiny_flux
from two_stream import make_batch, make_lora_model

from tightrope.memory.plan_cost import predict
from tightrope.memory.planner import candidate_strategies, plan
from tightrope.memory.probe import TOKEN_CHUNKS, probe_model
from tightrope.memory.profile import ChunkedBlock, Profile
from tightrope.memory.strategy import Strategy, StrategyError
from tightrope.training.lora.layers import LoraSpec, inject_lora

MB = 1 << 20


def synthetic(chunked=True, n=4) -> Profile:
    """Four 100 MB blocks whose plain forward + backward peaks at 600 MB; chunked: 150 MB, 20 % more compute."""
    fwd, bwd = 0.01, 0.02
    return Profile(
        device="cuda", batch=1, block_names=[f"b.{i}" for i in range(n)], block_types=["Double", "Double", "Single",
                                                                                       "Single"][:n],
        block_frozen=[100 * MB] * n, block_packed=[100 * MB] * n, block_trainable=[MB] * n, other_weight_bytes=10 * MB,
        trainable_bytes=4 * MB, trainable_numel=MB, act_full=[400 * MB] * n, act_ckpt=[10 * MB] * n,
        act_shared=MB, act_other=MB, fwd_s=[fwd] * n, bwd_s=[bwd] * n, other_s=0.001, h2d_bytes_per_s=24e9,
        block_peak_alloc=[600 * MB] * n, token_chunks=TOKEN_CHUNKS if chunked else 1,
        chunked=[ChunkedBlock(saved=50 * MB, peak=150 * MB, fwd_s=1.2 * fwd, bwd_s=bwd + 1.2 * fwd)] * n
        if chunked else None)


def test_a_chunked_strategy_takes_the_chunked_figures():
    prof = synthetic()
    s = Strategy.of(offload_fraction=1.0, checkpoint="all", activation_offload=True)
    plain, chunked = predict(prof, s), predict(prof, s.replace(token_chunks=TOKEN_CHUNKS))
    assert plain.breakdown["transient"] == 600 * MB - 10 * MB  # the block's peak less its kept inputs
    assert chunked.breakdown["transient"] == 150 * MB - 10 * MB
    assert plain.peak_bytes - chunked.peak_bytes >= 450 * MB
    # the recompute of the chunks makes each block slower: backward = its chunked backward + its chunked forward
    per_block = 1.2 * 0.01 + (0.02 + 1.2 * 0.01) + 1.2 * 0.01  # forward, backward, checkpoint's forward again
    assert chunked.compute_s == pytest.approx(prof.other_s + prof.optimizer_s + 4 * per_block)
    assert chunked.compute_s > plain.compute_s
    # measured, the forward the block's checkpoint reruns (output regions skipped) replaces the whole chunked forward
    rerun = dataclasses.replace(prof, chunked=[dataclasses.replace(c, recompute_s=0.004) for c in prof.chunked])
    per_block = 1.2 * 0.01 + (0.02 + 1.2 * 0.01) + 0.004
    assert predict(rerun, s.replace(token_chunks=TOKEN_CHUNKS)).compute_s == pytest.approx(
        prof.other_s + prof.optimizer_s + 4 * per_block)
    # a block measured without a chunked forward (None) keeps its own figures: its peak stays the transient
    partial = dataclasses.replace(prof, chunked=prof.chunked[:3] + [None])
    assert predict(partial, s.replace(token_chunks=TOKEN_CHUNKS)).breakdown["transient"] == 600 * MB - 10 * MB
    # and a profile without chunked figures predicts a chunking strategy as an unchunked one
    assert predict(synthetic(chunked=False), s.replace(token_chunks=TOKEN_CHUNKS)).peak_bytes == plain.peak_bytes


def test_the_planner_picks_chunks_only_when_nothing_else_fits():
    prof = synthetic()
    candidates = candidate_strategies(prof, Strategy())
    assert {s.checkpointing.token_chunks for s, _ in candidates} == {1, TOKEN_CHUNKS}
    assert {s.checkpointing.token_chunks for s, _ in candidate_strategies(synthetic(chunked=False), Strategy())} \
        == {1}
    unchunked = [(s, off) for s, off in candidates if s.checkpointing.token_chunks == 1]
    least_plain = min(predict(prof, s, offloaded=off).peak_bytes for s, off in unchunked)
    least = min(predict(prof, s, offloaded=off).peak_bytes for s, off in candidates)
    assert least < least_plain - 400 * MB
    tight = plan(prof, least_plain - 100 * MB)
    assert tight.strategy.checkpointing.token_chunks == TOKEN_CHUNKS and "token chunks" in tight.explanation
    # where everything fits without offload or recompute, that is fastest: no chunks
    roomy = plan(prof, predict(prof, Strategy()).peak_bytes)
    assert roomy.strategy.checkpointing == Strategy().checkpointing and not roomy.prediction.offloaded
    with pytest.raises(StrategyError, match="token chunks"):  # the least-peak plan is named with its chunks
        plan(prof, least - MB)


def test_profile_json_round_trip_with_chunked_figures_and_old_profiles_still_load():
    prof = dataclasses.replace(synthetic(), chunked=synthetic().chunked[:3] + [None])
    again = Profile.from_json(prof.to_json())
    assert again == prof and isinstance(again.chunked[0], ChunkedBlock) and again.chunked[3] is None
    old = prof.to_dict()
    del old["chunked"], old["token_chunks"]  # written before token chunks existed
    assert Profile.from_dict(old).chunked is None and Profile.from_dict(old).token_chunks == 1
    doubled = prof.at_batch(2)
    assert dataclasses.astuple(doubled.chunked[0])[:4] == pytest.approx((100 * MB, 300 * MB, 0.024, 0.064))
    assert doubled.chunked[0].recompute_s is None and doubled.chunked[3] is None  # not measured: stays unknown
    rerun = dataclasses.replace(prof, chunked=[c and dataclasses.replace(c, recompute_s=0.004) for c in prof.chunked])
    assert Profile.from_json(rerun.to_json()) == rerun and rerun.at_batch(2).chunked[0].recompute_s == 0.008
    with pytest.raises(ValueError, match="Profile.chunked has 3 entries but there are 4 blocks"):
        dataclasses.replace(prof, chunked=prof.chunked[:3])


def test_the_probe_measures_blocks_with_a_chunked_forward_chunked():
    model = tiny_flux()
    torch.manual_seed(2)
    inject_lora(model, LoraSpec(rank=4), "flux")

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 8, (1, 9, 3), generator=g).float()
        inputs = {"img": torch.randn(1, 6, 64, generator=g), "img_ids": ids[:, 3:], "txt": torch.randn(1, 3, 64,
                  generator=g), "txt_ids": ids[:, :3], "timesteps": torch.tensor([0.4]),
                  "y": torch.randn(1, 32, generator=g), "guidance": torch.tensor([3.5])}
        return inputs, lambda out: out.square().mean()

    prof = probe_model(model, make_inputs, "cpu", Strategy.of(compute_dtype="fp32"), repeats=0)
    assert prof.token_chunks == TOKEN_CHUNKS and len(prof.chunked) == prof.n_blocks == 4
    for i, c in enumerate(prof.chunked):  # q, k, v, attention's output and the chunks' inputs: less than all
        assert 0 < c.saved < prof.act_full[i] and c.peak == 0 and c.fwd_s > 0 and c.bwd_s > 0  # CPU: no peak
        assert c.recompute_s > 0  # timed; how it compares with fwd_s is the headline plan's FLOP count (no noise)
    assert Profile.from_json(prof.to_json()) == prof


def _inputs():
    inputs, target = make_batch()
    return inputs, lambda out: F.mse_loss(out, target)


def test_the_probe_reports_its_progress_block_by_block():
    """An `auto` strategy's probe takes minutes on a large model: the Train node shows a bar (nodes/host.py
    work_progress), told after every block measurement: each block alone, then each chunkable one chunked (and its
    checkpoint's rerun), ending at the total; an exception from the callback (ComfyUI's interrupt) ends the probe
    and leaves the model as it was."""
    seen = []
    model = make_lora_model()
    probe_model(model, _inputs, "cpu", Strategy.of(compute_dtype="fp32"), repeats=0,
                progress=lambda done, total: seen.append((done, total)))
    n = 6  # the test model's 3 double + 3 single blocks, all with chunked forwards (two_stream.py)
    assert seen == [(k, 3 * n) for k in range(1, 3 * n + 1)]

    class Interrupted(Exception):
        pass

    def interrupt(done, total):
        if done == 2:
            raise Interrupted
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(Interrupted):
        probe_model(model, _inputs, "cpu", Strategy.of(compute_dtype="fp32"), repeats=0, progress=interrupt)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
