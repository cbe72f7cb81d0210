import math

import pytest
from PIL import Image

from tightrope.training.data.buckets import choose_bucket, fit_to_bucket

SIZES = [(512, 512), (1024, 768), (768, 1024), (1920, 1080), (1080, 1920), (3000, 1000), (100, 50), (4000, 4001)]
BUDGETS = [(512 * 512, 16), (1024 * 1024, 16), (64 * 64, 4), (300_000, 64)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("max_pixels,multiple", BUDGETS)
def test_bucket_respects_budget_multiple_and_shape(size, max_pixels, multiple):
    w, h = size
    bw, bh = choose_bucket(w, h, max_pixels, multiple)
    assert bw * bh <= max_pixels and bw % multiple == 0 and bh % multiple == 0
    assert (bw > bh) == (w > h) or abs(w - h) <= 1  # orientation kept
    # Close in aspect (within what the grid allows) and not wasteful of the budget.
    assert abs(math.log((bw / bh) / (w / h))) < 0.08
    assert bw * bh >= 0.85 * max_pixels


def test_known_buckets():
    assert choose_bucket(512, 512, 512 * 512, 16) == (512, 512)
    assert choose_bucket(2000, 2000, 512 * 512, 16) == (512, 512)  # big images come down to the budget
    assert choose_bucket(64, 64, 1024 * 1024, 16) == (1024, 1024)  # small ones go up to it
    assert choose_bucket(1024, 768, 512 * 512, 16) == (576, 432)  # exact 4:3
    assert choose_bucket(1920, 1080, 512 * 512, 16) == (672, 384)  # not the tiny exact 512x288
    assert choose_bucket(1080, 1920, 512 * 512, 16) == (384, 672)
    assert choose_bucket(512, 512, 300_000, 64) == (512, 512)  # square stays square on a coarse grid
    assert choose_bucket(64, 64, 64 * 64, 4) == (64, 64)


def test_extreme_aspect_still_gives_a_valid_bucket():
    bw, bh = choose_bucket(7, 3000, 512 * 512, 16)
    assert bw == 16 and bh % 16 == 0 and bw * bh <= 512 * 512


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="max_pixels"):
        choose_bucket(10, 10, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        choose_bucket(10, 10, 4096, 0)
    with pytest.raises(ValueError, match="positive"):
        choose_bucket(0, 10, 4096, 4)


def test_fit_to_bucket_scales_and_crops_the_centre():
    image = Image.new("RGB", (300, 100), "red")
    image.paste(Image.new("RGB", (100, 100), "blue"), (100, 0))  # blue middle third
    out = fit_to_bucket(image, (64, 64))
    assert out.size == (64, 64)
    r, g, b = out.getpixel((32, 32))
    assert b > 200 and r < 50
    r, g, b = out.getpixel((1, 32))
    assert b > 200  # the red sides were cropped away, not squeezed in
    assert fit_to_bucket(image, (96, 32)).size == (96, 32)
