"""ComfyVaeEncoder / ComfyClipEncoder against stand-ins with ComfyUI's VAE and CLIP methods (no ComfyUI needed), and
the Demo Conditioning node's widths."""
import pytest
import torch
from torch import nn

from tightrope.training.data.comfy_encoders import ComfyClipEncoder, ComfyVaeEncoder
from tightrope.demo.model import demo_model
from tightrope.demo.conditioning import demo_conditioning
from tightrope.training.data.encoders import ImageEncoder, TextEncoder


class FakeVae:
    """ComfyUI's VAE surface: encode(BHWC in [0, 1]); a video VAE (latent_dim 3) returns (B, C, T, h, w)."""
    def __init__(self, seed=0, video=False):
        torch.manual_seed(seed)
        self.first_stage_model = nn.Conv2d(3, 16, 8, stride=8)
        self.latent_dim, self.calls = (3 if video else 2), []

    def spacial_compression_encode(self):
        return 8

    def encode(self, pixels):
        assert pixels.ndim == 4 and pixels.shape[-1] == 3 and 0 <= pixels.min() and pixels.max() <= 1
        self.calls.append(pixels.shape[0])
        with torch.no_grad():
            z = self.first_stage_model(pixels.movedim(-1, 1))
        return z[:, :, None] if self.latent_dim == 3 else z


class FakeClip:
    def __init__(self, width=32, pooled=8, pad_to=None):
        torch.manual_seed(0)
        self.cond_stage_model, self.layer_idx = nn.Linear(width, width), None
        self.width, self.pooled, self.pad_to = width, pooled, pad_to

    def tokenize(self, text):
        words = text.split() or [""]
        return {"t5": words + [""] * max(0, (self.pad_to or 0) - len(words))}

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
        n = len(tokens["t5"])
        return {"cond": torch.ones(1, n, self.width), "pooled_output": torch.ones(1, self.pooled) if self.pooled
                else None}


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_vae_encoder():
    vae = FakeVae()
    enc = ComfyVaeEncoder(vae)
    assert isinstance(enc, ImageEncoder) and enc.downscale == 8
    z = enc.encode(torch.rand(2, 3, 64, 32) * 2 - 1)
    assert z.shape == (2, 16, 8, 4) and vae.calls == [2]
    assert enc.cache_id == ComfyVaeEncoder(FakeVae()).cache_id != ComfyVaeEncoder(FakeVae(seed=1)).cache_id


def test_video_vae_encodes_each_image_as_one_frame():
    vae = FakeVae(video=True)
    z = ComfyVaeEncoder(vae).encode(torch.zeros(3, 3, 16, 16))
    assert z.shape == (3, 16, 2, 2) and vae.calls == [1, 1, 1]


class FakeVideoVae(FakeVae):
    """A video VAE over frames: (T, H, W, 3) -> (1, C, 1 + (T - 1) // 4, h, w) (Wan's time stride 4)."""
    def __init__(self):
        super().__init__(video=True)

    def temporal_compression_decode(self):
        return 4

    def encode(self, pixels):
        z = super().encode(pixels[::4])  # (T', C, 1, h, w)
        return z[:, :, 0].movedim(0, 1)[None]


def test_video_vae_encodes_a_clip_as_one_video():
    vae = FakeVideoVae()
    enc = ComfyVaeEncoder(vae)
    assert enc.frame_stride == 4 and ComfyVaeEncoder(FakeVae()).frame_stride == 1
    frames = torch.rand(9, 3, 16, 16) * 2 - 1
    z = enc.encode_video(frames)
    assert z.shape == (16, 3, 2, 2) and vae.calls == [3]  # one call: the 9 frames are one video
    with pytest.raises(ValueError, match="encode_video needs a video VAE"):
        ComfyVaeEncoder(FakeVae()).encode_video(frames)


def test_clip_encoder():
    enc = ComfyClipEncoder(FakeClip(pad_to=6))
    assert isinstance(enc, TextEncoder)
    context, pooled = enc.encode(["a red circle", "two words"])
    assert context.shape == (2, 6, 32) and pooled.shape == (2, 8)
    assert enc.cache_id == ComfyClipEncoder(FakeClip()).cache_id != ComfyClipEncoder(FakeClip(width=16)).cache_id


def test_clip_without_pooled_output_and_unpadded_lengths():
    enc = ComfyClipEncoder(FakeClip(pooled=0))
    context, pooled = enc.encode(["a red circle"])
    assert context.shape == (1, 3, 32) and pooled.shape == (1, 0)
    assert enc.encode(["two words"])[0].shape == (1, 2, 32) and enc.captions_per_call == 1
    with pytest.raises(ValueError, match="encodes to 2 tokens, the first of this call to 3: pass captions of one"):
        enc.encode(["a red circle", "two words"])


def _captioned_folder(root, captions):
    from PIL import Image
    root.mkdir()
    for i, caption in enumerate(captions):
        Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(caption)
    return root


def test_a_folder_with_captions_of_several_token_counts_trains_each_at_its_own_length(tmp_path):
    """Lumina 2's and Qwen-Image's encoders do not pad: Load Dataset refused any folder (the empty caption, encoded
    even without dropout, had another length). Each batch now holds one caption length; with dropout a batch drops
    all its captions or none, and each item is still dropped at the set rate."""
    captions = ["a red circle", "two words", "one", "a blue square", "three more words", "four words here now"]
    folder = _captioned_folder(tmp_path / "imgs", captions)
    from tightrope.training.data.dataset import TrainingDataset
    ds = TrainingDataset(folder, ComfyVaeEncoder(FakeVae()), ComfyClipEncoder(FakeClip(pooled=0)), max_pixels=32 * 32)
    assert ds.steps_per_epoch(2) == 5  # buckets of 1, 2, 3 and 4 tokens: 1, 1, 3 (two batches) and 1 captions
    seen = []
    for batch in _take(ds.batches(2, seed=0), 10):
        assert {len(c.split()) for c in batch["captions"]} == {batch["context"].shape[1]}
        seen += batch["captions"]
    assert sorted(set(seen)) == sorted(captions)

    ds = TrainingDataset(folder, ComfyVaeEncoder(FakeVae()), ComfyClipEncoder(FakeClip(pooled=0)), max_pixels=32 * 32,
                         caption_dropout=0.5)
    dropped = total = 0
    for batch in _take(ds.batches(2, seed=1), 400):
        kept = [c for c in batch["captions"] if c]
        assert len(kept) in (0, len(batch["captions"]))  # all or none
        assert batch["context"].shape[1] == (len(kept[0].split()) if kept else 1)  # "" tokenizes to one token
        dropped, total = dropped + len(batch["captions"]) - len(kept), total + len(batch["captions"])
    # 600 items, each dropped with p = 0.5 (batches are correlated pairs: sd <= sqrt(600 * 2) * 0.5 / 600 ~ 0.03)
    assert abs(dropped / total - 0.5) < 0.1


def test_not_comfyui_objects():
    with pytest.raises(TypeError, match="not a ComfyUI VAE"):
        ComfyVaeEncoder(object())
    with pytest.raises(TypeError, match="not a ComfyUI CLIP"):
        ComfyClipEncoder(object())


def test_demo_conditioning_sized_for_the_model():
    (context, extra), = demo_conditioning(demo_model(0), "a red circle", 8, 0)
    assert context.shape == (1, 8, 64) and extra["pooled_output"].shape == (1, 32)


def test_the_cache_id_sees_every_tensor_of_a_text_encoder_made_of_several():
    """SD3.5's CLIP is CLIP-L + CLIP-G + T5 in one module: a fine-tune of one part, same shapes, must change the id
    (it sampled the first and last three tensors by name, so a changed CLIP-L kept the id and its stale cached
    captions were trained on)."""
    class Parts(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.clip_g, self.clip_l, self.t5xxl = (nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
                                                    for _ in range(3))

    clip = FakeClip()
    clip.cond_stage_model = Parts()
    before = ComfyClipEncoder(clip).cache_id
    with torch.no_grad():
        clip.cond_stage_model.clip_l[1].weight.mul_(1.01)  # neither among the first nor the last three names
    assert ComfyClipEncoder(clip).cache_id != before


def test_lumina2_captions_are_encoded_as_comfyuis_lumina2_prompt_node_encodes_them():
    """Lumina 2 is sampled with CLIPTextEncodeLumina2 (comfy_extras/nodes_lumina2.py), which encodes
    "<system prompt> <Prompt Start> <prompt>": the captions (the empty dropout caption too) get the same prefix, and
    cached embeddings made without it are not reused. Other text encoders get the caption as it is."""
    class LuminaTokenizer:
        pass

    class Recording(FakeClip):
        def __init__(self, lumina):
            super().__init__()
            self.seen = []
            if lumina:
                self.tokenizer = LuminaTokenizer()

        def tokenize(self, text):
            self.seen.append(text)
            return super().tokenize(text)

    lumina, plain = Recording(True), Recording(False)
    encoder = ComfyClipEncoder(lumina)
    encoder.encode(["a red circle"])
    encoder.encode([""])
    encoder.encode(["a {red} circle"])  # braces in a caption are text
    ComfyClipEncoder(plain).encode(["a red circle"])
    prefix = ("You are an assistant designed to generate superior images with the superior degree of image-text "
              "alignment based on textual prompts or user prompts. <Prompt Start> ")
    assert lumina.seen == [prefix + "a red circle", prefix, prefix + "a {red} circle"]
    assert plain.seen == ["a red circle"]
    assert ComfyClipEncoder(lumina).cache_id != ComfyClipEncoder(Recording(False)).cache_id


def test_a_conditioning_with_image_inputs_is_refused():
    """An image-to-video / edit conditioning (WanImageToVideo's concat_latent_image, Kontext's reference_latents):
    training would drop the image that sampling feeds. Before: dropped silently."""
    from tightrope.training.data.builder import dataset_from_conditioning
    from tightrope.training.data.dataset import DatasetError
    cond = [[torch.randn(1, 4, 32), {"pooled_output": None, "concat_latent_image": torch.randn(1, 16, 1, 8, 8)}]]
    with pytest.raises(DatasetError, match="conditioning carries concat_latent_image .*plain CLIP Text Encode"):
        dataset_from_conditioning({"samples": torch.randn(1, 16, 8, 8)}, cond)
