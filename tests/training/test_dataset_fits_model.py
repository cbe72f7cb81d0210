"""A dataset encoded for another model (another VAE's latent channels, another text encoder's widths) is refused
before anything runs, naming the dataset input, the widths on both sides and the fix; it used to fail inside the
first forward with a matrix-shape error and a traceback (found driving a real ComfyUI server: an SDXL VAE's
4-channel latents into Flux, another text encoder's conditioning into Wan)."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.demo.model import demo_model
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")
TINY = demo_model().flux.params  # 16 latent channels (64 patchified), context 64, pooled 32


def tensors_dataset(n=2, channels=16, context=TINY.context_in_dim, pooled=TINY.vec_in_dim) -> TrainingDataset:
    g = torch.Generator().manual_seed(0)
    return TrainingDataset.from_tensors([torch.randn(channels, 8, 8, generator=g) for _ in range(n)],
                                        [torch.randn(6, context, generator=g) for _ in range(n)],
                                        [torch.randn(pooled, generator=g) for _ in range(n)])


@pytest.mark.parametrize("dataset, message", [
    (dict(channels=4), r"the dataset's latents have 4 channels, but this flux model \(tightrope-tiny-flux-seed0\) "
                       r"takes 16-channel latents: encode the images with this model's VAE"),
    (dict(context=48), r"the dataset's caption encodings have width 48, but this flux model .* takes text of width "
                       r"64: encode the captions with this model's text encoder\(s\)"),
    (dict(pooled=24), r"the dataset's pooled text embeddings have width 24, but this flux model .* takes width 32: "
                      r"encode the captions with this model's text encoders"),
])
def test_a_dataset_for_another_model_is_refused_before_anything_runs(tmp_path, dataset, message):
    session = demo_session(tmp_path).advanced(dataset=tensors_dataset(**dataset))
    save = SaveTarget(tmp_path / "out", "run", every=1)
    with pytest.raises(DatasetError, match=message):
        train(session, 2, device=CPU, save=save)
    assert not (tmp_path / "out").exists()  # refused before any set-up: nothing written


def test_a_validation_dataset_for_another_model_is_named_as_such(tmp_path):
    session = demo_session(tmp_path).advanced(validation_dataset=tensors_dataset(channels=4))
    with pytest.raises(DatasetError, match="the validation_dataset's latents have 4 channels"):
        train(session, 1, device=CPU)


def test_the_widths_are_read_from_shapes():
    assert tensors_dataset().encoded_widths() == ({16}, {64}, {32})
    assert tensors_dataset(channels=4, context=48, pooled=0).encoded_widths() == ({4}, {48}, {0})


def test_a_dataset_that_fits_trains(tmp_path):
    session = demo_session(tmp_path).advanced(dataset=tensors_dataset(n=2))
    assert train(session, 1, device=CPU).step == 1

