"""Bad inputs of video clips (training/data/video_clips.py): a clip in a folder given an image VAE, or with loss masks,
or without PyAV to decode it; a video LATENT for a model that takes image latents. Each fails before any clip is
decoded or any step runs. bad_input_run_cases.py appends these CASES to the whole list."""
from __future__ import annotations

import sys
from unittest import mock

import torch
from bad_input_cases import DATA, TRAIN, Case, train_with
from fake_video import VideoCodec, write_fake_video
from reliability_kit import load_dataset

from tightrope.training.data.dataset import TrainingDataset


def video_folder(ctx) -> str:
    folder = ctx.folder()
    write_fake_video(ctx.tmp / "data" / "clip.mp4")
    return folder


def without_pyav(ctx):
    with mock.patch.dict(sys.modules, {"av": None}):  # `import av` fails, as without the package
        load_dataset(video_folder(ctx), vae=VideoCodec())


def clips_for_an_image_model(ctx):
    from reliability_kit import world
    _, dataset, _, _ = world(ctx.out)
    context, pooled = dataset.text(0)
    clips = TrainingDataset.from_tensors([torch.randn(16, 3, 8, 8) for _ in range(4)], [context] * 4, [pooled] * 4)
    train_with(ctx, dataset=clips)


CASES = [
    Case("video_image_vae", "a video clip in the folder, an image VAE", DATA, "DatasetError",
         ("clip.mp4' needs a video VAE", "connect the video model's own VAE"),
         lambda c: load_dataset(video_folder(c))),
    Case("video_without_pyav", "a video clip in the folder, PyAV not installed", DATA, "DatasetError",
         ("holds videos", "pip install av"), without_pyav),
    Case("video_with_masks", "a video clip in the folder, mask=alpha", DATA, "DatasetError",
         ("mask='alpha'", "set mask to none"), lambda c: load_dataset(video_folder(c), mask="alpha")),
    Case("video_latents_image_model", "video latents for a model that takes image latents (Flux)", TRAIN,
         "DatasetError", ("video clip(s)", "train a video model (Wan)"), clips_for_an_image_model),
]
