"""benchmarks/png.py: a plot rewritten by quantize_png is a palette PNG that looks like the
original and takes fewer bytes. The plot here is drawn with Pillow (the package that
matplotlib saves through): lines, markers and text of a few colours on white, anti-aliased."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from benchmark_scripts import load

png = load("png")


def draw_plot(path: Path) -> None:
    image = Image.new("RGBA", (600, 300), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((40, 20, 580, 270), outline="black")
    for k, colour in enumerate(((214, 39, 40), (31, 119, 180), (0, 0, 0))):
        points = [(50 + 26 * i, 250 - 30 * ((i * (k + 1)) % 7)) for i in range(20)]
        draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
        draw.text((460, 30 + 15 * k), f"series {k}", fill=colour)
    image.save(path)


def test_a_plot_keeps_its_look_in_fewer_bytes(tmp_path: Path) -> None:
    path = tmp_path / "plot.png"
    draw_plot(path)
    with Image.open(path) as image:
        original = np.asarray(image.convert("RGB"), dtype=np.int16)
    size = path.stat().st_size
    png.quantize_png(path)
    with Image.open(path) as image:
        assert image.mode == "P" and image.size == (600, 300)
        small = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert np.abs(small - original).mean() < 1.0
    assert (small == original).all(axis=2).mean() > 0.99  # most pixels keep their colour
    assert path.stat().st_size < size
