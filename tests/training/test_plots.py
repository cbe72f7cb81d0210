"""Pillow charts: right size, something drawn, and bad data handled without crashing."""
import math

import pytest
import torch
from PIL import Image

from tightrope.training.charts import (image_to_comfy, line_chart, nice_ticks, pareto_front, scatter_chart)


def _colours(img: Image.Image) -> int:
    return len(img.convert("RGB").getcolors(maxcolors=1 << 20) or [])


def _not_blank(img: Image.Image) -> bool:
    lo, hi = img.convert("L").getextrema()
    return lo < 128 < hi and _colours(img) > 10


def test_line_chart_size_and_content():
    img = line_chart({"loss": [1.0, 0.5, 0.3, 0.2], "val": [(0, 1.2), (3, 0.4)]}, title="Loss", xlabel="step",
                     ylabel="loss", width=500, height=300)
    assert isinstance(img, Image.Image) and img.size == (500, 300)
    assert _not_blank(img)


@pytest.mark.parametrize("series", [
    {}, {"a": []}, {"a": [float("nan"), float("inf")]}, {"a": [1.0, float("nan"), 2.0]},
    {"const": [3.0, 3.0, 3.0]}, {"one": [5.0]}, {"zero": [0.0, 0.0]},
])
@pytest.mark.parametrize("log_y", [False, True])
def test_line_chart_survives_bad_data(series, log_y):
    img = line_chart(series, title="t", xlabel="x", ylabel="y", log_y=log_y)
    assert img.size == (640, 360)
    assert img.convert("L").getextrema()[0] < 128  # at least the title or "no data" is drawn


def test_constant_series_is_drawn_in_the_middle():
    img = line_chart({"c": [2.0] * 10}, width=400, height=300)
    # the line's colour appears on the middle row band of the plot
    band = img.crop((80, 130, 300, 210)).convert("RGB")
    assert any(c[1] == (0x4e, 0x79, 0xa7) for c in band.getcolors(1 << 16))


def test_scatter_chart_marks_the_frontier():
    pts = [(3.0, 1.0, "a"), (2.0, 2.0, "b"), (1.0, 3.0, "c"), (3.0, 3.0, "d"), (float("nan"), 1.0, "e")]
    img = scatter_chart(pts, title="Frontier", xlabel="GiB", ylabel="s/step")
    assert img.size == (720, 420) and _not_blank(img)
    assert scatter_chart([], title="none").size == (720, 420)


def test_pareto_front():
    pts = [(3.0, 1.0), (2.0, 2.0), (1.0, 3.0), (3.0, 3.0), (2.5, 2.5)]
    assert pareto_front(pts) == [2, 1, 0]
    assert pareto_front(pts, y_lower_is_better=False) == [2]
    assert pareto_front([(1.0, 1.0), (2.0, 5.0)], y_lower_is_better=False) == [0, 1]


def test_ticks_are_round_numbers():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.0013, 0.0041) == pytest.approx([0.002, 0.003, 0.004])
    assert nice_ticks(3, 3) == [3]
    assert all(math.isfinite(t) for t in nice_ticks(-5e9, 7e9))


def test_image_to_comfy():
    img = Image.new("RGB", (7, 5), (255, 0, 128))
    t = image_to_comfy(img)
    assert t.shape == (1, 5, 7, 3) and t.dtype == torch.float32
    torch.testing.assert_close(t[0, 0, 0], torch.tensor([1.0, 0.0, 128 / 255]))
    assert image_to_comfy(Image.new("L", (3, 2), 255)).shape == (1, 2, 3, 3)


class _Reads(list):
    """A list that counts the values read from it."""
    reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


def test_the_loss_curves_running_mean_reads_each_loss_at_most_twice():
    """It summed its window again for each point: 100,000 steps read 500 million losses (3 s), 350,000 steps 40 s."""
    from tightrope.training.charts import running_mean
    values = [math.sin(i) + 2.0 for i in range(5000)]
    values[1000], values[3000] = math.nan, math.inf  # a skipped step's NaN loss: only the windows holding it
    losses = _Reads(values)
    smooth = running_mean(losses, 250)
    assert losses.reads <= 2 * len(values)
    for i in (0, 10, 999, 1000, 1249, 1250, 2999, 3249, 3250, 4999):
        window = values[max(0, i - 249): i + 1]
        expected = sum(window) / len(window)
        assert (math.isnan(smooth[i]) and not math.isfinite(expected)) or smooth[i] == pytest.approx(expected, 1e-12)
