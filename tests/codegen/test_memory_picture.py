"""The memory picture: a valid PNG whose bars are as tall as the plan's memory figures, to the pixel."""
from __future__ import annotations

import dataclasses
import struct
import zlib

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from xirang.codegen.memory_picture import BAR, LIMIT, OVER, PLOT_HEIGHT, layout, write_memory_png
from xirang.ir.plan_parts import Prediction

GiB = 1024**3


def read_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB rows) of an 8-bit truecolour PNG with filter 0 rows, checking every CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks = 8, {}
    while position < len(data):
        (length,) = struct.unpack(">I", data[position:position + 4])
        kind, body = data[position + 4:position + 8], data[position + 8:position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length:position + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = chunks.get(kind, b"") + body
        position += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, interlace) == (8, 2, 0) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == height * stride and all(raw[r * stride] == 0 for r in range(height))
    return width, height, b"".join(raw[r * stride + 1:(r + 1) * stride] for r in range(height))


@pytest.fixture(scope="module")
def plan_pp4():
    torch.manual_seed(0)
    ids = torch.zeros(8, 32, dtype=torch.long)
    plan = xirang.plan(build_gpt("tiny"), world=4, device="cpu", example_kwargs={"input_ids": ids, "labels": ids},
                       global_batch=8, pp=2, dp=2)
    # memory figures chosen so the bars differ clearly and one crosses the limit
    memory = (30 * GiB, 60 * GiB)
    stages = tuple(dataclasses.replace(s, memory_limit_bytes=50 * GiB) for s in plan.stages)
    predicted = dataclasses.replace(plan.predicted, memory_bytes_per_device=memory)
    return dataclasses.replace(plan, predicted=predicted, stages=stages)


def _column_height(width, rgb, x, colour) -> int:
    height = len(rgb) // (3 * width)
    return sum(1 for y in range(height) if tuple(rgb[(y * width + x) * 3:(y * width + x) * 3 + 3]) == colour)


def test_bars_are_proportional_to_memory_and_the_limit_is_drawn(plan_pp4, tmp_path):
    path = write_memory_png(plan_pp4, tmp_path / "mem.png")
    width, height, rgb = read_png(path.read_bytes())
    geometry = layout(plan_pp4)
    assert (width, height) == (geometry["width"], geometry["height"])
    (x0a, _, x1a, _), (x0b, _, x1b, _) = geometry["bars"]
    # count bar pixels in a column away from the limit line's rows: rank 0 fits (blue), rank 1 does not
    a = _column_height(width, rgb, (x0a + x1a) // 2, BAR)
    b = _column_height(width, rgb, (x0b + x1b) // 2, OVER) + 2  # the 2-pixel limit line crosses bar 1
    top = 60 * GiB * 1.1
    assert a == round(30 * GiB / top * PLOT_HEIGHT) and b == round(60 * GiB / top * PLOT_HEIGHT)
    assert abs(b / a - 2.0) < 0.02  # 60 GiB is twice 30 GiB
    line_y = geometry["limit_y"]
    assert tuple(rgb[(line_y * width + 5 + width // 2) * 3:][:3]) == LIMIT
    assert round((geometry["base"] - line_y) / PLOT_HEIGHT * top / GiB) == 50


def test_a_zero_figure_draws_no_bar_and_a_small_one_keeps_a_pixel(plan_pp4, tmp_path):
    real = dataclasses.replace(plan_pp4, predicted=Prediction(
        step_seconds=1.0, tflops_per_device=1.0, memory_bytes_per_device=(0, 1024)))
    path = write_memory_png(real, tmp_path / "m.png")
    width, _, rgb = read_png(path.read_bytes())
    (x0, _, x1, _), (x0b, _, x1b, _) = layout(real)["bars"]
    assert _column_height(width, rgb, (x0 + x1) // 2, BAR) == 0  # zero bytes draws no bar
    assert _column_height(width, rgb, (x0b + x1b) // 2, BAR) == 1  # 1 KiB of 50 GiB still shows
