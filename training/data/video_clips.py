"""Video clips in a folder dataset: read with PyAV, resampled to a frame rate, fitted to a bucket, encoded as one video.

A clip (.mp4 .webm .mov .mkv .avi .flv: what ComfyUI 0.33's dataset nodes take) trains as ONE sample of its first
`frames` frames (the head of the clip) at `fps` frames a second: output frame i is the source frame shown at time
i / fps (the latest one starting at or before it; a slower source repeats frames, a faster one skips them). fps 0
keeps the source's own frames. A video VAE (Wan's: 4x in time) encodes F = 1 + 4k frames to 1 + k latent frames, so a
frame count that is not of that form is rounded down (said once); a clip shorter than frames / fps seconds trains on
the frames it has, rounded down the same way (said per clip). Every frame is fitted to the clip's aspect-ratio bucket
(resolution^2 pixels a frame, buckets.py) like an image, so a clip's latent is (C, T', h, w) and clips of another T'
or h, w never share a batch (batching.py buckets by latent shape). Images in the same folder train as 1-frame videos.

PyAV (`av`) is imported only when a folder holds a video: ComfyUI installs it; without it a video is a one-line error.
"""
from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch
from torch import Tensor

from ..state.atomic_write import atomic_save_file
from .buckets import choose_bucket, fit_to_bucket
from .cache_files import cached_shapes
from .folder_warnings import UPSCALE_WARNING_FACTOR
from .image_folder import VIDEO_EXTENSIONS, DatasetError, image_to_tensor, to_rgb
from .image_hashes import file_key_or_none
from .keys import content_key

CLIP_VERSION = "head-latest-tick-lanczos-v2"  # bump when frame picking or fitting changes: old latents stop matching
DEFAULT_FRAMES = 33  # 2 s at 16 fps; Wan takes 1 + 4k frames (81 at 16 fps is its 5 s sampling default)
DEFAULT_FPS = 16.0   # Wan 2.1 and Wan 2.2 A14B are trained and sampled at 16 fps (the 5B TI2V at 24: set fps 24)


@dataclass(frozen=True)
class ClipSettings:
    """How clips become samples: `frames` per clip from its head, resampled to `fps` (0: the source's rate)."""
    frames: int = DEFAULT_FRAMES
    fps: float = DEFAULT_FPS

    def __post_init__(self):
        if not isinstance(self.frames, int) or isinstance(self.frames, bool) or self.frames < 1:
            raise DatasetError(f"frames={self.frames!r}: a clip needs at least 1 frame; set frames to 1 + 4k for Wan "
                               "(e.g. 33 or 81)")
        if not self.fps >= 0:  # NaN too
            raise DatasetError(f"fps={self.fps!r} is invalid: give the frame rate to train at (16 for Wan 2.1/2.2 "
                               "A14B, 24 for Wan 2.2 5B), or 0 for the source's own rate")

    def cache_key(self, frames: int) -> str:
        """Part of a clip's latent cache key: every setting that changes its frames."""
        return f"clip frames={frames} fps={self.fps!r} {CLIP_VERSION}"


def is_video(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS


def frames_for(frames: int, stride: int) -> int:
    """The most frames <= `frames` that a video VAE with time stride `stride` encodes whole: 1 + stride * k."""
    return 1 + (frames - 1) // stride * stride if stride > 1 else frames


def clip_frame_count(settings: ClipSettings, stride: int, said: set | None = None) -> int:
    """settings.frames rounded down to 1 + stride * k, said once per value (said: the values said already)."""
    count = frames_for(settings.frames, stride)
    if count != settings.frames and (said is None or settings.frames not in said):
        if said is not None:
            said.add(settings.frames)
        warnings.warn(f"frames={settings.frames}: the video VAE encodes 1 + {stride}k frames (its time stride is "
                      f"{stride}), so each clip trains on its first {count} frames; set frames to {count} or "
                      f"{count + stride} to silence this", stacklevel=2)
    return count


def pick_frames(times: list[float], end: float, fps: float, count: int, tol: float = 1e-6) -> list[int]:
    """Indices into the source frames (start times `times`, ascending; the last one shown until `end`) of the clip's
    first `count` frames at `fps`: frame i is the one shown at times[0] + i / fps. fps 0: the first `count` frames.
    Fewer where the clip ends first. tol: how far apart two times may be and be the same (time_tolerance)."""
    if fps == 0:
        return list(range(min(count, len(times))))
    picked = []
    for i in range(count):
        at = times[0] + i / fps
        if at >= end - tol:
            break
        picked.append(bisect.bisect_right(times, at + tol) - 1)
    return picked


def time_tolerance(time_base, rate) -> float:
    """How much later than an output frame's time a source frame may start and still be the one shown at it: a
    container stores times rounded to its time base (Matroska, WebM, FLV: 1 ms), so a 24 fps frame that starts at
    1/24 s is stored at 0.042 s, after the output frame at 1/24 s of a 24 fps clip (which then showed frame 0 twice
    and skipped frame 1). A time base as coarse as a quarter frame or more (AVI: one frame) holds times exactly."""
    tick = float(time_base or 0)
    return max(1e-6, tick) if 0 < tick <= 0.25 / float(rate) else 1e-6


def _av():
    try:
        import av
    except ImportError:
        raise DatasetError("the dataset folder holds videos, which need PyAV to decode: pip install av (ComfyUI "
                           "installs it; headless, install it into the python that runs tightrope), or remove the "
                           "videos") from None
    return av


def _unreadable(path: Path, error: Exception) -> DatasetError:
    return DatasetError(f"cannot read video '{path}' ({error}): re-encode it as H.264 .mp4 (e.g. ffmpeg -i in.mov "
                        "-c:v libx264 out.mp4), or delete it (strict=False skips such files)")


def read_video_size(path: Path) -> tuple[int, int]:
    """(width, height) of the clip's frames as trained (its rotation applied, as ComfyUI's Load Video applies it),
    from its first frame."""
    av = _av()
    try:
        with av.open(str(path)) as container:
            stream = _stream(container, path)
            size = int(stream.codec_context.width), int(stream.codec_context.height)
            frame = next(iter(container.decode(stream)), None)
            if frame is not None:
                size = frame.width, frame.height
            return size[::-1] if _quarter_turns(frame) % 2 else size
    except DatasetError:
        raise
    except Exception as e:  # PyAV raises its own error types for damaged and foreign files
        raise _unreadable(path, e) from None


def _quarter_turns(frame) -> int:
    """The frame's display rotation (a phone's portrait clip) in quarter turns counter-clockwise, as ComfyUI's
    VideoFromFile applies it (np.rot90 by rotation // 90)."""
    rotation = getattr(frame, "rotation", 0) or 0
    return int(round(rotation // 90)) % 4


def _stream(container, path: Path):
    if not container.streams.video:
        raise DatasetError(f"'{path}' holds no video stream: remove it from the dataset folder")
    return container.streams.video[0]


def read_clip(path: Path, settings: ClipSettings, count: int, bucket: tuple[int, int], max_pixels: int) -> list:
    """The clip's first `count` frames at settings.fps, each fitted to `bucket` (8-bit RGB PIL images): fewer where
    the clip is shorter. Only the frames picked (pick_frames) are converted and fitted, as they are decoded: a source
    faster than fps holds no frame it skips (a 240 fps clip at 16 fps fitted and held 15 frames for each one used)."""
    av = _av()
    times, kept, pending = [], {}, None  # kept: index -> fitted frame, of the frames picked; pending: the last one
    target = 0  # the next output frame not yet placed: it is shown at times[0] + target / fps

    def fitted(frame):
        image = to_rgb(frame.to_image())
        turns = _quarter_turns(frame)
        return fit_to_bucket(image.rotate(90 * turns, expand=True) if turns else image, bucket)

    def place(until: float, last: bool) -> None:
        """Settle `pending` (frame len(times) - 1, shown until `until`): kept where an output frame shows it, as
        pick_frames picks (the latest frame starting at or before the output frame's time; none past the end)."""
        nonlocal target
        picked = False
        while target < count and (times[0] + target / settings.fps < until - tol if last
                                  else times[0] + target / settings.fps + tol < until):
            picked, target = True, target + 1
        if picked:
            kept[len(times) - 1] = fitted(pending)

    try:
        with av.open(str(path)) as container:
            stream = _stream(container, path)
            rate = stream.average_rate or stream.guessed_rate or Fraction(25)
            tol = time_tolerance(getattr(stream, "time_base", None), rate)
            # AVI holds no presentation times: FFmpeg gives its frames their packets' (decode order: with B-frames,
            # 1 4 3 5 2 ... for frames in order, which dropped frames 1, 2, 4, ...); its frames are timed by index
            by_index = getattr(getattr(container, "format", None), "name", "") == "avi"
            horizon = None if settings.fps == 0 else (count - 1) / settings.fps
            for frame in container.decode(stream):
                width, height = frame.width, frame.height
                if width * height > max_pixels:
                    raise DatasetError(f"video '{path}' has {width}x{height} frames, over the limit of {max_pixels} "
                                       "pixels a frame: downscale it, or remove it from the folder")
                at = float(frame.time) if frame.time is not None and not by_index else len(times) / float(rate)
                if times and at <= times[-1]:  # a repeated or out-of-order timestamp: keep the first
                    continue
                if settings.fps == 0:
                    if len(times) == count:
                        break
                    times.append(at)
                    kept[len(times) - 1] = fitted(frame)
                    continue
                if pending is not None:
                    place(at, last=False)
                if horizon is not None and times and at - times[0] > horizon + tol:
                    times.append(at)  # the frame after the last one needed: only its time is kept (the end)
                    pending = None
                    break
                times.append(at)
                pending = frame
            if pending is not None:  # the stream ended: its last frame is shown for one frame's time
                place(times[-1] + 1 / float(rate), last=True)
    except DatasetError:
        raise
    except Exception as e:
        raise _unreadable(path, e) from None
    shown = len(times) - 1 if settings.fps and pending is None and len(times) > 1 else len(times)
    if not times or not kept:
        raise DatasetError(f"video '{path}' has no frames that decode: re-encode it, or remove it from the folder")
    end = times[shown] if len(times) > shown else times[shown - 1] + 1 / float(rate)
    return [kept[i] for i in pick_frames(times[:shown], end, settings.fps, count, tol)]


def clip_to_tensor(frames: list) -> Tensor:
    """PIL frames -> (T, 3, H, W) float32 in [-1, 1], as image_to_tensor per frame."""
    return torch.stack([image_to_tensor(frame) for frame in frames])


def encode_clip(path: Path, encoder, settings: ClipSettings, count: int, bucket: tuple[int, int],
                max_pixels: int) -> Tensor:
    """The clip's latent (C, T', h, w) by the encoder's encode_video (one video), on the CPU."""
    encode_video = getattr(encoder, "encode_video", None)
    if encode_video is None or not getattr(encoder, "video", True):
        raise video_encoder_error(path, encoder)
    frames = read_clip(path, settings, count, bucket, max_pixels)
    stride = int(getattr(encoder, "frame_stride", 1))
    usable = frames_for(len(frames), stride)
    if len(frames) < count:
        warnings.warn(f"video '{path}' is shorter than {count} frames at {settings.fps:g} fps: it trains on its "
                      f"{usable} frames (a sample of its own length: another bucket)", stacklevel=2)
    with torch.no_grad():
        latent = encode_video(clip_to_tensor(frames[:usable]))
    if latent.ndim == 4 and latent.shape[1] == 1:  # one latent frame: an image's latent, batched with images
        latent = latent[:, 0]
    return latent.detach().to("cpu").contiguous().clone()


def video_encoder_error(path: Path, encoder) -> DatasetError:
    return DatasetError(f"video '{path}' needs a video VAE, but the VAE input ({getattr(encoder, 'cache_id', '?')}) "
                        "encodes images only: connect the video model's own VAE (Wan's), or remove the videos from "
                        "the folder")


def clip_bucket(path: Path, max_pixels: int, multiple: int) -> tuple[int, int]:
    """The clip's aspect-ratio bucket, as an image's; a clip enlarged more than UPSCALE_WARNING_FACTOR is said."""
    width, height = read_video_size(path)
    bucket = choose_bucket(width, height, max_pixels, multiple)
    factor = max(bucket[0] / width, bucket[1] / height)
    if factor > UPSCALE_WARNING_FACTOR:
        warnings.warn(f"video '{path}' is {width}x{height}, upscaled {factor:.1f}x to its {bucket[0]}x{bucket[1]} "
                      "bucket, which trains blur: use a larger clip, or lower the Load Dataset resolution",
                      stacklevel=3)
    return bucket


def check_video_masks(entries, mask: str) -> None:
    """Loss masks are read per image: a folder with videos takes none (DatasetError before any encoding)."""
    videos = [e.path for e in entries if is_video(e.path)]
    if mask != "none" and videos:
        raise DatasetError(f"mask={mask!r} gives images loss masks, but the folder holds videos (e.g. '{videos[0]}'), "
                           "which take none: set mask to none, or train the videos from another folder")


class ClipEncoding:
    """TrainingDataset's clip half (a mixin over its `_cache_path(kind, key)` and encoding counters)."""

    @staticmethod
    def _clip_plan(entries, encoder, clips: ClipSettings | None) -> tuple[ClipSettings, int]:
        """The clip settings and the frames a clip is cut to; a folder with videos needs a video encoder and PyAV."""
        clips = ClipSettings() if clips is None else clips
        videos = [e.path for e in entries if is_video(e.path)]
        if videos and (not hasattr(encoder, "encode_video") or not getattr(encoder, "video", True)):
            raise video_encoder_error(videos[0], encoder)
        if videos:
            _av()  # here, not per clip: without PyAV, strict=False would skip every clip with a warning each
        return clips, clip_frame_count(clips, int(getattr(encoder, "frame_stride", 1))) if videos else clips.frames

    def _encode_clip(self, path: Path, encoder, max_pixels: int, multiple: int, max_image_pixels: int,
                     hashes, clips: ClipSettings, count: int,
                     trust: bool = True) -> tuple:
        """_encode_image's for a video file: its latent (C, T', h, w), keyed by its bytes and the clip settings."""
        # streamed, not read whole: a clip can be gigabytes of which only the head is decoded (it is decoded from
        # the file, which must still be the bytes hashed when the latent is made)
        digest, hashed = hashes.stream_digest(path, trust=trust)
        bucket = clip_bucket(path, max_pixels, multiple)
        key = content_key(digest, encoder.cache_id, f"{bucket[0]}x{bucket[1]}", clips.cache_key(count))
        cache_path = self._cache_path("latents", key)
        shapes = cached_shapes(cache_path, ("latent",)) if cache_path else None
        if shapes:
            self.image_cache_hits += 1
            return cache_path, shapes["latent"], None, digest
        if hashed is None:  # to be encoded: hashed now, so the latent is keyed by the bytes it is made of
            if trust:
                return self._encode_clip(path, encoder, max_pixels, multiple, max_image_pixels, hashes, clips, count,
                                         False)
            raise DatasetError(f"video '{path}' changed while it was read: load the dataset again")
        latent = encode_clip(path, encoder, clips, count, bucket, max_image_pixels)
        if file_key_or_none(path) != hashed:
            raise DatasetError(f"video '{path}' changed while it was read: load the dataset again")
        self.encoded_images += 1
        if cache_path:
            atomic_save_file({"latent": latent}, cache_path)
            return cache_path, tuple(latent.shape), None, digest
        return latent, tuple(latent.shape), None, digest

