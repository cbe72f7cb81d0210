"""Clips through the whole run on the CPU, with a video-capable stand-in for Wan (the reference Flux reading a clip's
frames stacked along its height: the trainer only needs predict on (B, C, T, h, w)): training, validation, the
`auto` plan's probe and resume's dataset fingerprint all see each clip with its frames."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.training import auto_plan
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.models.adapter import ReferenceFluxModel
from tightrope.training.strategy_choice import AutoStrategy
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


class VideoFlux(ReferenceFluxModel):
    """Takes video latents (B, C, T, h, w); images get a time axis of 1, as ComfyUI's Wan latent format gives them."""
    seen: list = []

    def takes_video(self) -> bool:
        return True

    def process_latents(self, latents):
        return latents.unsqueeze(2) if latents.ndim == 4 else latents

    def predict(self, module, x_t, t, context, pooled, guidance, to_device=None):
        self.seen.append(tuple(x_t.shape))
        b, c, frames, h, w = x_t.shape
        flat = x_t.reshape(b, c, frames * h, w)
        out = super().predict(module, flat, t, context, pooled, guidance, to_device)
        return out.reshape(b, c, frames, h, w)


def clip_session(tmp_path, **config):
    session = demo_session(tmp_path, **config)
    context, pooled = session.dataset.text(0)
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(16, 3, 8, 8, generator=g) for _ in range(4)] + [torch.randn(16, 8, 8, generator=g)] * 2
    data = TrainingDataset.from_tensors(latents, [context] * 6, [pooled] * 6)
    VideoFlux.seen = []
    return session.advanced(model=VideoFlux(session.model.flux), dataset=data)


def test_clips_train_and_validate_with_their_frames(tmp_path):
    session = clip_session(tmp_path, batch_size=2, validation_fraction=0.34, validation_every=2)
    result = train(session, 3, device=CPU, save=SaveTarget(tmp_path / "out", "run", every=0))
    assert len(result.losses) == 3 and all(v == v for v in result.losses)
    assert result.validation_losses and all(v == v for _, v in result.validation_losses)
    assert {s[2] for s in VideoFlux.seen} == {1, 3}  # clips of 3 latent frames, images of 1, never mixed in a batch
    assert all(len(s) == 5 for s in VideoFlux.seen)


def test_auto_probes_the_clips(tmp_path, monkeypatch):
    """4 clips of 3 x 8 x 8 outweigh images of 8 x 8: the probe sees a batch of clips, frames included."""
    session = clip_session(tmp_path, batch_size=2)
    probed = []

    def probe(model, make_inputs, device, base, *, batch, repeats, progress=None):
        probed.append((tuple(make_inputs()[0]["x_t"].shape), batch))
        raise StopIteration
    monkeypatch.setattr(auto_plan, "probe_model", probe)
    with pytest.raises(StopIteration):
        auto_plan.plan_for_session(session, AutoStrategy(vram_budget_gb=4.0), CPU)
    assert probed == [((2, 16, 3, 8, 8), 2)]
