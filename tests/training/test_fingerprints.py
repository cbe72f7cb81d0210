"""What a state file records of a run's inputs: the exact model digest tells weights apart that the similarity check
takes for the same model (another dtype, a LoRA's patches on a GGUF weight), and the dataset digest sees every
latent and text encoding, not only the first and last."""
import copy

import torch
from torch import nn

from tightrope.training.data.builder import dataset_from_conditioning
from tightrope.training.state.fingerprints import dataset_fingerprint, model_fingerprint, model_mismatch


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))


def test_the_same_weights_give_the_same_digest_and_another_dtype_another():
    a, b = _model(), _model()
    assert model_fingerprint(a, "flux") == model_fingerprint(b, "flux")
    half = copy.deepcopy(a).to(torch.bfloat16)
    saved, now = model_fingerprint(a, "flux"), model_fingerprint(half, "flux")
    assert model_mismatch(saved, now) is None  # the loose check: the same model, in another dtype
    assert saved["exact"] != now["exact"]


def test_a_dense_change_of_any_one_weight_changes_the_digest():
    """A LoRA on the MODEL changes every element of the layers it patches (B @ A is dense): one layer scaled by
    (1 + 1e-3) is below the similarity check's reach, not the digest's."""
    a, b = _model(), _model()
    with torch.no_grad():
        b[1].weight.mul_(1 + 1e-3)
    saved, now = model_fingerprint(a, "flux"), model_fingerprint(b, "flux")
    assert model_mismatch(saved, now) is None and saved["exact"] != now["exact"]


def test_patches_a_layer_applies_itself_count():
    """ComfyUI-GGUF leaves the bytes as loaded and lists the MODEL's LoRA on the weight (`patches`): strength 1.0
    and 0.3 of the same LoRA are different models."""
    factors = (torch.randn(64, 4), torch.randn(4, 64))

    def patched(strength):
        m = _model()
        m[1].weight.patches = [([(strength, factors, 1.0, None, None)], "diffusion_model.1.weight")]
        return model_fingerprint(m, "flux")["exact"]
    assert patched(1.0) == patched(1.0) != patched(0.3)
    assert patched(1.0) != model_fingerprint(_model(), "flux")["exact"]


def _dataset(latents, context):
    return dataset_from_conditioning({"samples": latents}, [[context, {"pooled_output": torch.zeros(1, 8)}]])


def test_the_dataset_digest_sees_a_middle_latent_and_the_text_encoding():
    g = torch.Generator().manual_seed(0)
    latents, context = torch.randn(5, 4, 8, 8, generator=g), torch.randn(1, 6, 16, generator=g)
    base = dataset_fingerprint(_dataset(latents, context))
    assert dataset_fingerprint(_dataset(latents.clone(), context.clone())) == base
    middle = latents.clone()
    middle[2, 0, 3, 3] += 1e-3
    assert dataset_fingerprint(_dataset(middle, context)) != base
    assert dataset_fingerprint(_dataset(latents, context * 1.001)) != base  # another text encoder, same captions
