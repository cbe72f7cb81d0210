"""Video clips for tests without PyAV: a stand-in `av` module (video_clips._av's seam) that "decodes" small text
files `FAKEVIDEO width height frames fps rotation`, frame k a solid colour from k; and a video encoder over the demo
codec (a time stride of 4, like Wan's VAE). Tests with the real PyAV write real clips with write_mp4."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import torch
from PIL import Image

from tightrope.demo.encoders import DemoLatentCodec


def colour(k: int) -> tuple[int, int, int]:
    return (k * 5) % 256, (k * 11 + 40) % 256, (255 - k * 7) % 256


def write_fake_video(path: Path, width=32, height=32, frames=40, fps=32, caption="a clip", rotation=0,
                     ticks=0) -> Path:
    """ticks: the container's time base is 1/ticks s, frame times rounded to it (Matroska: 1000); 0: exact."""
    path.write_text(f"FAKEVIDEO {width} {height} {frames} {fps} {rotation} {ticks}")
    path.with_suffix(".txt").write_text(caption)
    return path


class _Frame:
    def __init__(self, k, width, height, fps, rotation, ticks=0):
        self.k, self.width, self.height, self.time, self.rotation = k, width, height, k / fps, rotation
        if ticks:
            self.time = round(k / fps * ticks) / ticks

    def to_image(self):
        return Image.new("RGB", (self.width, self.height), colour(self.k))


class _Container:
    def __init__(self, spec: str):
        _, w, h, n, fps, rotation, *ticks = spec.split()
        self.w, self.h, self.n, self.fps, self.rotation = int(w), int(h), int(n), int(fps), int(rotation)
        self.ticks = int(ticks[0]) if ticks else 0
        stream = type("Stream", (), {})()
        stream.codec_context = type("Codec", (), {"width": self.w, "height": self.h})()
        stream.average_rate = Fraction(self.fps)
        stream.guessed_rate = None
        stream.time_base = Fraction(1, self.ticks) if self.ticks else None
        self.streams = type("Streams", (), {"video": [stream]})()

    def decode(self, stream):
        for k in range(self.n):
            FakeAv.decoded += 1
            yield _Frame(k, self.w, self.h, self.fps, self.rotation, self.ticks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _read(source) -> bytes:
    with open(source, "rb") as f:  # as a decoder reads (not Path.read_bytes, which a test watches)
        return f.read()


class FakeAv:
    """What video_clips reads of PyAV: av.open(path or BytesIO) -> a container with streams.video and decode()."""
    opened = decoded = 0

    @classmethod
    def open(cls, source):
        cls.opened += 1
        data = source.getvalue() if hasattr(source, "getvalue") else _read(source)
        text = data.decode()
        if not text.startswith("FAKEVIDEO"):
            raise ValueError("invalid data found when processing input")
        return _Container(text)


def use_fake_av(monkeypatch) -> type[FakeAv]:
    from tightrope.training.data import video_clips
    FakeAv.opened = FakeAv.decoded = 0
    monkeypatch.setattr(video_clips, "_av", lambda: FakeAv)
    return FakeAv


class VideoCodec(DemoLatentCodec):
    """The demo codec as a video VAE: a clip of 1 + 4k frames -> 1 + k latent frames (frames 0, 4, 8, ... encoded)."""
    frame_stride = 4
    video = True

    def __init__(self, seed=0):
        super().__init__(seed)
        self.clips = []

    @property
    def cache_id(self) -> str:
        return f"video-{super().cache_id}"

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        assert frames.ndim == 4 and (frames.shape[0] - 1) % 4 == 0, frames.shape
        self.clips.append(frames.shape[0])
        return self.encode(frames[::4]).movedim(0, 1)


def write_mp4(path: Path, frames: list, fps: int) -> Path:
    """Real H.264-or-MPEG-4 clip of PIL frames with PyAV (the test must skip without it)."""
    import av
    with av.open(str(path), "w") as out:
        try:
            stream = out.add_stream("libx264", rate=fps)
            stream.options = {"crf": "0", "preset": "ultrafast"}
        except Exception:
            stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
