import os
import subprocess
import sys

import torch

from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data.encoders import ImageEncoder, TextEncoder


def test_codec_is_exactly_invertible_with_the_documented_shapes():
    codec = DemoLatentCodec()
    x = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = codec.encode(x)
    assert z.shape == (2, 16, 32, 24) and z.dtype == x.dtype
    assert (codec.decode(z) - x).abs().max() < 1e-6
    assert codec.downscale == 2 and codec.latent_channels == 16
    assert isinstance(codec, ImageEncoder)


def test_codec_mixes_signal_into_every_channel_and_depends_on_its_seed():
    x = torch.rand(1, 3, 8, 8) * 2 - 1
    z = DemoLatentCodec().encode(x)
    assert (z.abs().flatten(2).amax(-1) > 0).all()  # the 4 padding channels don't stay zero
    assert not torch.equal(z, DemoLatentCodec(seed=1).encode(x))
    assert DemoLatentCodec().cache_id != DemoLatentCodec(seed=1).cache_id


def test_embedder_shapes_padding_and_empty_caption():
    emb = DemoCaptionEmbedder()
    long = " ".join(f"word{i}" for i in range(40))
    context, pooled = emb.encode(["a red circle", "", long])
    assert context.shape == (3, 16, 64) and pooled.shape == (3, 32)
    assert torch.equal(context[0, 3], context[0, 15])  # padding rows are one fixed vector
    assert not torch.equal(context[0, 2], context[0, 3])
    assert not torch.equal(context[1], context[0]) and pooled[1].abs().sum() > 0  # "" has its own embedding
    assert torch.equal(emb.encode(["A Red, circle!"])[0], context[:1])  # case and punctuation ignored
    assert isinstance(emb, TextEncoder)


DIGEST = """
import hashlib, torch
def digest(emb):
    context, pooled = emb.encode(["a red circle on a blue background", ""])
    data = torch.cat([context.flatten(), pooled.flatten()]).view(torch.uint8).tolist()
    return hashlib.sha256(bytes(data)).hexdigest()
"""


def test_embedder_is_deterministic_across_instances_and_processes():
    scope = {}
    exec(DIGEST, scope)
    here = scope["digest"](DemoCaptionEmbedder())
    assert here == scope["digest"](DemoCaptionEmbedder())
    # A fresh interpreter with a different hash salt must agree (no Python hash() inside).
    code = DIGEST + "from tightrope.demo.encoders import DemoCaptionEmbedder\nprint(digest(DemoCaptionEmbedder()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == here
