"""Charts drawn with Pillow alone (matplotlib is not a dependency): a session's loss curve and per-step memory and
transfers (loss_chart, memory_chart: the Plots node), benchmark sweeps, and the memory-vs-speed frontier. Every chart
returns a `PIL.Image.Image`; `image_to_comfy` turns one into ComfyUI's IMAGE.

Bad data never crashes a chart: NaN/inf points (and non-positive ones on a log axis) are dropped, an empty chart
says "no data", and a constant series gets a small range around its value.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import torch
from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from .session import TrainingSession

# Tableau 10: distinct under common colour-vision deficiencies, and readable on white
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
BACKGROUND, AXIS, GRID, TEXT, FRONTIER = "white", "#333333", "#e6e6e6", "#222222", "#d62728"


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)  # scalable when Pillow has FreeType
    except (TypeError, OSError):
        return ImageFont.load_default()


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _points(values: Sequence, log_y: bool) -> list[tuple[float, float]]:
    """A series as (x, y) pairs: plain numbers get x = 0, 1, 2, ...; unusable points are dropped."""
    pts = []
    for i, v in enumerate(values):
        x, y = (v if isinstance(v, (tuple, list)) else (i, v))[:2]
        if _finite(x) and _finite(y) and (y > 0 or not log_y):
            pts.append((float(x), float(y)))
    return pts


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k steps) covering [lo, hi]."""
    if not (_finite(lo) and _finite(hi)) or hi <= lo:
        return [lo] if _finite(lo) else []
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, k = [], 0
    while first + k * step <= hi + step * 1e-9:
        ticks.append(round(first + k * step, 12))
        k += 1
    return ticks


def format_number(v: float) -> str:
    """Short, readable tick labels: 0.25, 12, 3.5k, 1.2M, 2e-05."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.3g}G"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 1e-3:
        return f"{v:.4g}"
    return f"{v:.1e}"


class _Axes:
    """Maps data to pixels inside the plot area and draws the frame, grid, ticks and labels."""

    def __init__(self, img: Image.Image, xs: list[float], ys: list[float], *, title: str, xlabel: str, ylabel: str,
                 log_y: bool, legend_width: int = 0):
        self.img, self.draw = img, ImageDraw.Draw(img)
        self.font, self.small, self.big = _font(13), _font(12), _font(15)
        self.log_y = log_y
        w, h = img.size
        self.left, self.right, self.top, self.bottom = 70, w - 16 - legend_width, 34, h - 46
        self.x0, self.x1 = _padded_range(xs, pad=0.03)
        if log_y:
            ly = [math.log10(y) for y in ys]
            lo, hi = _padded_range(ly, pad=0.05)
            self.y0, self.y1 = lo, hi
        else:
            self.y0, self.y1 = _padded_range(ys, pad=0.05)
        self.draw.text((w // 2, 8), title, fill=TEXT, font=self.big, anchor="ma")
        self.draw.text(((self.left + self.right) // 2, h - 6), xlabel, fill=TEXT, font=self.font, anchor="md")
        self._vertical_label(ylabel)
        self._grid_and_ticks()

    def px(self, x: float, y: float) -> tuple[float, float]:
        yv = math.log10(y) if self.log_y else y
        fx = (x - self.x0) / (self.x1 - self.x0)
        fy = (yv - self.y0) / (self.y1 - self.y0)
        return self.left + fx * (self.right - self.left), self.bottom - fy * (self.bottom - self.top)

    def _grid_and_ticks(self) -> None:
        d = self.draw
        for t in nice_ticks(self.x0, self.x1):
            x, _ = self.px(t, 1.0 if self.log_y else self.y0)
            d.line([(x, self.top), (x, self.bottom)], fill=GRID)
            d.line([(x, self.bottom), (x, self.bottom + 4)], fill=AXIS)
            d.text((x, self.bottom + 6), format_number(t), fill=TEXT, font=self.small, anchor="ma")
        if self.log_y:
            ticks = [10 ** e for e in range(math.floor(self.y0), math.ceil(self.y1) + 1)
                     if self.y0 <= e <= self.y1] or [10 ** self.y0, 10 ** self.y1]
        else:
            ticks = nice_ticks(self.y0, self.y1)
        for t in ticks:
            _, y = self.px(self.x0, t)
            d.line([(self.left, y), (self.right, y)], fill=GRID)
            d.line([(self.left - 4, y), (self.left, y)], fill=AXIS)
            d.text((self.left - 6, y), format_number(t), fill=TEXT, font=self.small, anchor="rm")
        d.rectangle([self.left, self.top, self.right, self.bottom], outline=AXIS)

    def _vertical_label(self, text: str) -> None:
        if not text:
            return
        box = self.draw.textbbox((0, 0), text, font=self.font)
        tile = Image.new("RGBA", (box[2] - box[0] + 4, box[3] - box[1] + 4), (255, 255, 255, 0))
        ImageDraw.Draw(tile).text((2 - box[0], 2 - box[1]), text, fill=TEXT, font=self.font)
        tile = tile.rotate(90, expand=True)
        y = (self.top + self.bottom - tile.height) // 2
        self.img.paste(tile, (6, max(0, y)), tile)

    def legend(self, entries: list[tuple[str, str]], x: int | None = None) -> None:
        x = self.right + 10 if x is None else x
        for k, (label, colour) in enumerate(entries):
            y = self.top + 4 + 16 * k
            self.draw.rectangle([x, y + 2, x + 10, y + 12], fill=colour)
            self.draw.text((x + 14, y), _shorten(label, 24), fill=TEXT, font=self.small)


def _padded_range(values: list[float], pad: float) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):  # constant: centre it in a small range
        half = abs(hi) * 0.1 or 1.0
        return lo - half, hi + half
    span = hi - lo
    return lo - pad * span, hi + pad * span


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _blank(width: int, height: int, title: str, message: str = "no data") -> Image.Image:
    img = Image.new("RGB", (width, height), BACKGROUND)
    d = ImageDraw.Draw(img)
    d.text((width // 2, 8), title, fill=TEXT, font=_font(15), anchor="ma")
    d.text((width // 2, height // 2), message, fill="#888888", font=_font(13), anchor="mm")
    return img


def _legend_width(labels: list[str]) -> int:
    return min(190, 30 + 7 * max((len(_shorten(s, 24)) for s in labels), default=0)) if labels else 0


def line_chart(series: dict[str, list[float] | list[tuple[float, float]]], *, title: str = "", xlabel: str = "",
               ylabel: str = "", width: int = 640, height: int = 360, log_y: bool = False) -> Image.Image:
    """One line per series (with dots, so single points show); plain lists are plotted against their index."""
    cleaned = {name: sorted(_points(vals, log_y)) for name, vals in series.items()}
    cleaned = {k: v for k, v in cleaned.items() if v}
    if not cleaned:
        return _blank(width, height, title)
    xs = [x for pts in cleaned.values() for x, _ in pts]
    ys = [y for pts in cleaned.values() for _, y in pts]
    img = Image.new("RGB", (width, height), BACKGROUND)
    ax = _Axes(img, xs, ys, title=title, xlabel=xlabel, ylabel=ylabel, log_y=log_y,
               legend_width=_legend_width(list(cleaned)))
    entries = []
    for k, (name, pts) in enumerate(cleaned.items()):
        colour = PALETTE[k % len(PALETTE)]
        xy = [ax.px(x, y) for x, y in pts]
        if len(xy) > 1:
            ax.draw.line(xy, fill=colour, width=2)
        if len(xy) <= 60:
            for x, y in xy:
                ax.draw.ellipse([x - 2.5, y - 2.5, x + 2.5, y + 2.5], fill=colour)
        entries.append((name, colour))
    ax.legend(entries)
    return img


def pareto_front(points: list[tuple[float, float]], *, y_lower_is_better: bool = True) -> list[int]:
    """Indices of points no other point beats on both axes (lower x is better; y per the flag), sorted by x."""
    sign = 1.0 if y_lower_is_better else -1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], sign * points[i][1]))
    front, best = [], math.inf
    for i in order:
        y = sign * points[i][1]
        if y < best:
            front.append(i)
            best = y
    return front


def scatter_chart(points: list[tuple[float, float, str]], *, title: str = "", xlabel: str = "", ylabel: str = "",
                  width: int = 720, height: int = 420, log_y: bool = False, y_lower_is_better: bool = True,
                  label_points: bool = True) -> Image.Image:
    """Labelled points with the Pareto frontier drawn through them (e.g. x = peak memory, y = seconds per step:
    the frontier holds the configurations nothing else beats on both). Points of one label share a colour."""
    usable = [(float(x), float(y), str(lab)) for x, y, lab in points
              if _finite(x) and _finite(y) and (y > 0 or not log_y)]
    if not usable:
        return _blank(width, height, title)
    labels = list(dict.fromkeys(lab for _, _, lab in usable))
    colours = {lab: PALETTE[k % len(PALETTE)] for k, lab in enumerate(labels)}
    img = Image.new("RGB", (width, height), BACKGROUND)
    ax = _Axes(img, [p[0] for p in usable], [p[1] for p in usable], title=title, xlabel=xlabel, ylabel=ylabel,
               log_y=log_y, legend_width=_legend_width(labels + ["Pareto frontier"]))
    front = pareto_front([(x, y) for x, y, _ in usable], y_lower_is_better=y_lower_is_better)
    xy = [ax.px(usable[i][0], usable[i][1]) for i in front]
    if len(xy) > 1:
        ax.draw.line(xy, fill=FRONTIER, width=2)
    for x, y, lab in usable:
        px, py = ax.px(x, y)
        ax.draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colours[lab], outline=AXIS)
    for px, py in xy:
        ax.draw.ellipse([px - 7, py - 7, px + 7, py + 7], outline=FRONTIER, width=2)
    if label_points and len(labels) > len(PALETTE):  # colours repeat: name the frontier points in place
        for i in front:
            px, py = ax.px(usable[i][0], usable[i][1])
            ax.draw.text((px + 8, py - 6), _shorten(usable[i][2], 18), fill=TEXT, font=ax.small)
    ax.legend([(lab, colours[lab]) for lab in labels[: len(PALETTE)]] + [("Pareto frontier", FRONTIER)])
    return img


def image_to_comfy(img: Image.Image) -> torch.Tensor:
    """A PIL image as ComfyUI's IMAGE: float32 (1, H, W, 3) in [0, 1]."""
    rgb = img.convert("RGB")
    data = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return data.view(1, rgb.height, rgb.width, 3).to(torch.float32) / 255.0


# ------------------------------------------------------------------------------------------------ a session
def loss_chart(session: TrainingSession) -> Image.Image:
    losses = list(session.losses)
    window = max(1, len(losses) // 20)
    series = {"loss": losses, f"mean of {window}": running_mean(losses, window)}
    if session.validation_losses:  # at the steps done when scored; a training loss at the steps done before it
        series["validation"] = [(float(step), loss) for step, loss in session.validation_losses]
    title = "Training and validation loss" if session.validation_losses else "Training loss"
    return line_chart(series, title=title, xlabel="step", ylabel=f"flow-matching loss ({session.config.loss})")


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the `window` - 1 before it (fewer at the start), reading each value twice: a sum per
    point made the loss chart quadratic in the steps (3 s at 100,000 steps, 40 s at 350,000). A window holding a NaN
    or an infinity gives NaN (a point the chart drops), as its sum did."""
    out, total, nonfinite = [], 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            total += v
        else:
            nonfinite += 1
        if i >= window:
            old = values[i - window]
            if math.isfinite(old):
                total -= old
            else:
                nonfinite -= 1
        out.append(math.nan if nonfinite else total / min(i + 1, window))
    return out


def memory_chart(session: TrainingSession) -> Image.Image:
    stats = session.stats
    gib = 2 ** 30
    series = {"peak allocated (GiB)": [s["peak_allocated_bytes"] / gib for s in stats],
              "streamed in (GiB)": [s["h2d_bytes"] / gib for s in stats],
              "step time (s)": [s["step_time_s"] for s in stats],
              "transfer wait (s)": [s["transfer_wait_s"] for s in stats]}
    return line_chart(series, title="Memory and transfers per step", xlabel="step", ylabel="GiB / seconds")
