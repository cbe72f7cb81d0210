"""Video clips in a folder dataset (training/data/video_clips.py): each clip is one sample of its first `frames`
frames resampled to `fps`, fitted to its aspect-ratio bucket, encoded as ONE video (C, T', h, w); cached under its
bytes and the frame settings; images in the same folder stay 1-frame samples. Decoding goes through a stand-in PyAV
(fake_video.py) so this runs without av; test_real_mp4_* use the real one and skip without it."""
import sys
import warnings
from fractions import Fraction

import pytest
import torch
from fake_video import VideoCodec, colour, use_fake_av, write_fake_video
from PIL import Image

from tightrope.demo.data import make_demo_dataset
from tightrope.demo.encoders import DemoCaptionEmbedder, DemoLatentCodec
from tightrope.training.data.buckets import choose_bucket
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.data.image_folder import DatasetError, image_to_tensor
from tightrope.training.data.video_clips import ClipSettings, frames_for, pick_frames, read_clip


def _load(folder, codec=None, cache=None, frames=9, fps=16.0, **kw):
    return TrainingDataset(folder, codec or VideoCodec(), DemoCaptionEmbedder(), max_pixels=32 * 32, cache_dir=cache,
                           clips=ClipSettings(frames, fps), **kw)


@pytest.fixture
def mixed(tmp_path, monkeypatch):
    """2 images of 32x32 and a 40-frame 32 fps clip of 32x32 (frame k coloured colour(k))."""
    folder = make_demo_dataset(tmp_path / "data", n_images=2, size=32)
    write_fake_video(folder / "clip.mp4")
    return folder, use_fake_av(monkeypatch)


def test_pick_frames_resamples_the_head_of_the_clip():
    times = [k / 30 for k in range(90)]  # 3 s at 30 fps
    assert pick_frames(times, 3.0, 15, 5) == [0, 2, 4, 6, 8]
    assert pick_frames(times, 3.0, 16, 5) == [0, 1, 3, 5, 7]  # frame i: the one shown at i / 16 s
    assert pick_frames(times[:8], 8 / 30, 60, 5) == [0, 0, 1, 1, 2]  # a slower source repeats frames
    assert pick_frames(times[:3], 0.1, 16, 33) == [0, 1]  # the clip ends first: fewer
    assert pick_frames(times, 3.0, 0, 4) == [0, 1, 2, 3]  # fps 0: the source's frames
    assert [frames_for(n, 4) for n in (1, 4, 5, 8, 9, 33, 34)] == [1, 1, 5, 5, 9, 33, 33]


def test_a_clip_is_one_sample_of_its_resampled_frames_encoded_as_one_video(mixed):
    folder, av = mixed
    codec = VideoCodec()
    data = _load(folder, codec)
    shapes = sorted(data.latent_shape(i) for i in range(data.num_images))
    assert shapes == [(16, 3, 16, 16), (16, 16, 16), (16, 16, 16)]  # 9 frames -> 3 latent frames; images: 1
    assert codec.clips == [9] and data.clip_count() == 1
    clip = next(i for i in range(3) if len(data.latent_shape(i)) == 4)
    expected = torch.stack([image_to_tensor(Image.new("RGB", (32, 32), colour(2 * k))) for k in range(9)])
    assert torch.equal(data.latent(clip), VideoCodec().encode_video(expected))  # 32 fps -> 16: every 2nd frame
    assert data.caption(clip) == "a clip"
    assert av.decoded == 1 + 18  # its size (first frame), then up to the last frame needed (16, at 0.5 s) and one more
    batch_shapes = {tuple(b["latents"].shape) for b, _ in zip(data.batches(1, seed=0), range(10))}
    assert batch_shapes == {(1, 16, 16, 16), (1, 16, 3, 16, 16)}


def test_clips_are_cached_under_their_bytes_and_frame_settings(mixed, tmp_path):
    folder, av = mixed
    first = _load(folder, cache=tmp_path / "cache")
    assert (first.encoded_images, first.image_cache_hits) == (3, 0)
    av.decoded = 0
    again = _load(folder, cache=tmp_path / "cache")
    assert (again.encoded_images, again.image_cache_hits, av.decoded) == (0, 3, 1)  # its first frame: its size
    clip = next(i for i in range(3) if len(again.latent_shape(i)) == 4)
    assert torch.equal(again.latent(clip), first.latent(clip))
    for change in (dict(frames=13), dict(fps=8.0)):  # another frame count or rate: the clip alone encodes again
        other = _load(folder, cache=tmp_path / "cache", **{"frames": 9, "fps": 16.0, **change})
        assert (other.encoded_images, other.image_cache_hits) == (1, 2)
        assert other.content_digest() != first.content_digest()  # resume's dataset fingerprint sees the change
    write_fake_video(folder / "clip.mp4", frames=41)  # other bytes
    assert _load(folder, cache=tmp_path / "cache").encoded_images == 1


def test_a_clip_is_hashed_streamed_and_decoded_from_its_file_not_read_whole(mixed, tmp_path, monkeypatch):
    """A clip can be gigabytes of which only the head trains: it is never held in memory whole (Path.read_bytes),
    with a cache or without, first load or cache miss; a clip that changes while it is encoded is refused."""
    from pathlib import Path
    folder, av = mixed
    read_whole, read_bytes = [], Path.read_bytes

    def recording(self):
        read_whole.append(self.name)
        return read_bytes(self)
    monkeypatch.setattr(Path, "read_bytes", recording)
    for cache in (None, tmp_path / "cache", tmp_path / "cache"):
        data = _load(folder, cache=cache, frames=5 if cache is None else 9)
        assert data.clip_count() == 1
    _load(folder, cache=tmp_path / "cache", frames=13)  # a cache miss with the digest from the index
    assert "clip.mp4" not in read_whole
    from tightrope.training.data import video_clips
    encode = video_clips.encode_clip

    def rewritten(path, *args):
        latent = encode(path, *args)
        write_fake_video(path, frames=41)  # other bytes than those hashed
        return latent
    monkeypatch.setattr(video_clips, "encode_clip", rewritten)
    with pytest.raises(DatasetError, match="changed while it was read"):
        _load(folder, cache=tmp_path / "cache", frames=17)


def test_only_the_frames_picked_are_fitted_and_held(tmp_path, monkeypatch):
    """A source much faster than fps: each frame skipped is neither converted nor fitted to the bucket nor held
    (a 240 fps clip at 16 fps fitted 15 frames for each one it trains on)."""
    from tightrope.training.data import video_clips
    use_fake_av(monkeypatch)
    clip = write_fake_video(tmp_path / "fast.mp4", frames=400, fps=240)
    fitted, fit = [], video_clips.fit_to_bucket
    monkeypatch.setattr(video_clips, "fit_to_bucket", lambda image, bucket: fitted.append(1) or fit(image, bucket))
    frames = read_clip(clip, ClipSettings(9, 16.0), 9, (32, 32), 10 ** 6)
    assert [f.getpixel((0, 0)) for f in frames] == [colour(15 * k) for k in range(9)]
    assert len(fitted) == 9
    fitted.clear()
    slow = write_fake_video(tmp_path / "slow.mp4", frames=5, fps=8)  # repeated frames are fitted once
    assert [f.getpixel((0, 0)) for f in read_clip(slow, ClipSettings(9, 16.0), 9, (32, 32), 10 ** 6)] == \
        [colour(k // 2) for k in range(9)] and len(fitted) == 5


@pytest.mark.parametrize("fps,src", [(24, 24), (16, 16), (30, 30), (15, 30), (16, 48)])
def test_times_rounded_to_the_containers_ticks_pick_the_frames_they_stand_for(tmp_path, monkeypatch, fps, src):
    """Matroska / WebM / FLV store times in 1 ms ticks: a 24 fps clip's frame 1 is stored at 0.042 s, after 1/24 s.
    It is still the frame shown at 1/24 s (a 24 fps clip at fps 24 showed frames 0, 0, 2, 3, 3, 5, ...)."""
    use_fake_av(monkeypatch)
    clip = write_fake_video(tmp_path / "clip.mkv", frames=60, fps=src, ticks=1000)
    frames = read_clip(clip, ClipSettings(13, float(fps)), 13, (32, 32), 10 ** 6)
    assert [f.getpixel((0, 0)) for f in frames] == [colour(i * src // fps) for i in range(13)]
    from tightrope.training.data.video_clips import time_tolerance
    assert time_tolerance(None, 24) == time_tolerance(Fraction(1, 24), 24) == 1e-6  # AVI: times exact, in frames
    assert time_tolerance(Fraction(1, 1000), 24) == 0.001


def test_avi_frames_are_timed_by_their_index(tmp_path, monkeypatch):
    """AVI has no presentation times: FFmpeg times its H.264 frames with B-frames out of order (1 4 3 5 2 ...) though
    they decode in order; those frames were dropped as repeats (a 30 fps clip at 15 fps gave frames 0 0 3 3 7 7)."""
    from tightrope.training.data import video_clips
    av = use_fake_av(monkeypatch)
    clip = write_fake_video(tmp_path / "clip.avi", frames=30, fps=30)
    open_clip, order = av.open, [1, 4, 3, 5, 2, 8, 7, 9, 6, 12, 11, 13, 10] + list(range(14, 40))

    def avi(source):
        container = open_clip(source)
        container.format = type("Format", (), {"name": "avi"})()
        frames = container.decode

        def decode(stream):
            for frame, pts in zip(frames(stream), order):
                frame.time = pts / 30
                yield frame
        container.decode = decode
        return container
    monkeypatch.setattr(video_clips, "_av", lambda: type("Av", (), {"open": staticmethod(avi)}))
    frames = read_clip(clip, ClipSettings(9, 15.0), 9, (32, 32), 10 ** 6)
    assert [f.getpixel((0, 0)) for f in frames] == [colour(2 * i) for i in range(9)]


def test_frames_not_of_the_vae_form_are_rounded_down_once(mixed):
    folder, _ = mixed
    with pytest.warns(UserWarning, match=r"frames=11: the video VAE encodes 1 \+ 4k frames .* first 9 frames"):
        data = _load(folder, frames=11)
    assert (16, 3, 16, 16) in data.bucket_counts


def test_a_short_clip_trains_on_the_frames_it_has(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    write_fake_video(folder / "short.webm", frames=7, fps=16)
    use_fake_av(monkeypatch)
    with pytest.warns(UserWarning, match=r"video '.*short.webm' is shorter than 33 frames at 16 fps: it trains on "
                                         r"its 5 frames"):
        data = _load(folder, frames=33)
    assert data.latent_shape(0) == (16, 2, 16, 16)


def test_clips_bucket_by_aspect_ratio_like_images(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    write_fake_video(folder / "wide.mov", width=64, height=32)
    use_fake_av(monkeypatch)
    width, height = choose_bucket(64, 32, 32 * 32, 4)  # an image's bucket: 2:1 in 32x32 pixels
    assert width > 2 * height - 4 and _load(folder).latent_shape(0) == (16, 3, height // 2, width // 2)


def test_a_small_clip_is_said_to_be_upscaled(tmp_path, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    write_fake_video(folder / "tiny.mp4", width=8, height=8)
    use_fake_av(monkeypatch)
    with pytest.warns(UserWarning, match=r"video '.*tiny.mp4' is 8x8, upscaled 4.0x to its 32x32 bucket, which trains "
                                         r"blur"):
        _load(folder)


def test_a_rotated_clip_trains_upright(tmp_path, monkeypatch):
    """A phone's portrait clip: 64x32 stored, rotated a quarter turn on display (as ComfyUI's Load Video turns it)."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_fake_video(folder / "phone.mp4", width=64, height=32, rotation=90)
    use_fake_av(monkeypatch)
    width, height = choose_bucket(32, 64, 32 * 32, 4)
    assert _load(folder).latent_shape(0) == (16, 3, height // 2, width // 2) and height > width


def test_an_image_vae_refuses_videos_in_one_line(mixed):
    folder, _ = mixed
    with pytest.raises(DatasetError, match=r"video '.*clip.mp4' needs a video VAE, but the VAE input \(demo-latent"
                                           r".*\) encodes images only: connect the video model's own VAE"):
        _load(folder, DemoLatentCodec())


def test_a_comfyui_image_vae_refuses_videos(mixed):
    """ComfyUI's VAE object of an image model (latent_dim 2: Flux's, SDXL's) has encode_video through our adapter,
    but encodes images only."""
    from torch import nn

    from tightrope.training.data.comfy_encoders import ComfyVaeEncoder

    class ImageVae:
        first_stage_model, latent_dim = nn.Conv2d(3, 16, 8, stride=8), 2

        def encode(self, pixels):
            raise AssertionError("nothing is encoded")
    folder, _ = mixed
    with pytest.raises(DatasetError, match=r"video '.*clip.mp4' needs a video VAE, but the VAE input \(comfy-vae-"
                                           r"Conv2d-.*\) encodes images only"):
        _load(folder, ComfyVaeEncoder(ImageVae()))


def test_masks_refuse_a_folder_with_videos(mixed):
    folder, _ = mixed
    with pytest.raises(DatasetError, match=r"mask='alpha' gives images loss masks, but the folder holds videos"):
        _load(folder, mask="alpha")


def test_without_pyav_a_video_is_a_one_line_error(tmp_path, monkeypatch):
    folder = make_demo_dataset(tmp_path / "data", n_images=1, size=32)
    write_fake_video(folder / "clip.mkv")
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    for strict in (True, False):  # not a problem of one clip: strict=False does not skip the clips
        with pytest.raises(DatasetError, match=r"the dataset folder holds videos, which need PyAV to decode: pip "
                                               r"install av"):
            _load(folder, strict=strict)


def test_a_damaged_video_is_skipped_when_not_strict(mixed):
    folder, _ = mixed
    (folder / "broken.mp4").write_bytes(b"not a video")
    (folder / "broken.txt").write_text("broken")
    with pytest.raises(DatasetError, match=r"cannot read video '.*broken.mp4' \(invalid data .*\): re-encode it"):
        _load(folder)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert _load(folder, strict=False).num_images == 3


@pytest.mark.parametrize("settings, message", [(dict(frames=0), "frames=0: a clip needs at least 1 frame"),
                                               (dict(fps=float("nan")), "fps=nan is invalid")])
def test_bad_clip_settings(settings, message):
    with pytest.raises(DatasetError, match=message):
        ClipSettings(**settings)


def _real_av():
    try:
        import av  # noqa: F401
    except ImportError:
        pytest.skip("PyAV (av) is not installed in this python: pip install av (ComfyUI's venv has it)")


def test_real_mp4_decodes_resampled_and_fitted(tmp_path):
    _real_av()
    from fake_video import write_mp4
    frames = [Image.new("RGB", (48, 32), colour(k * 4)) for k in range(20)]
    path = write_mp4(tmp_path / "clip.mp4", frames, fps=30)
    got = read_clip(path, ClipSettings(5, 15.0), 5, (32, 32), 10**8)
    assert len(got) == 5 and all(g.size == (32, 32) for g in got)
    for k, g in enumerate(got):  # frames 0, 2, 4, 6, 8 (lossy codec: colours within a few levels)
        assert max(abs(a - b) for a, b in zip(g.getpixel((16, 16)), colour(8 * k))) <= 12, (k, g.getpixel((16, 16)))
