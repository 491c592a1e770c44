"""The memory picture: a valid PNG whose bars are as tall as the plan's memory figures, to the pixel,
with its title, axis, values and legend written where its layout says."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.png_reader import read_png
from xirang.codegen.viz.memory_picture import (BAR, INK, LIMIT, OVER, PLOT_HEIGHT, SCALE, draw_memory, layout,
                                           write_memory_png)
from xirang.codegen.viz.png_canvas import Canvas, text_size
from xirang.ir.plan_parts import Prediction

GiB = 1024**3


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


def _column_height(width, rgb, x, colour, rows) -> int:
    return sum(1 for y in rows if tuple(rgb[(y * width + x) * 3:(y * width + x) * 3 + 3]) == colour)


def test_bars_are_proportional_to_memory_and_the_limit_is_drawn(plan_pp4, tmp_path):
    path = write_memory_png(plan_pp4, tmp_path / "mem.png")
    width, height, rows = read_png(path.read_bytes())
    rgb = b"".join(rows)
    geometry = layout(plan_pp4)
    assert (width, height) == (geometry["width"], geometry["height"])
    plot = range(geometry["plot_top"], geometry["base"])
    (x0a, _, x1a, _), (x0b, _, x1b, _) = geometry["bars"]
    # count bar pixels in a column away from the limit line's rows: rank 0 fits (blue), rank 1 does not
    a = _column_height(width, rgb, (x0a + x1a) // 2, BAR, plot)
    b = _column_height(width, rgb, (x0b + x1b) // 2, OVER, plot) + 2  # the 2-pixel limit line crosses bar 1
    # 60 GiB x 1.1 = 66 GiB of room: ticks every 20 GiB, so the scale ends on the 80 GiB tick
    assert geometry["ticks"][-1] == (geometry["plot_top"], "80") and geometry["ticks"][0] == (geometry["base"], "0")
    top = 80 * GiB
    assert a == round(30 * GiB / top * PLOT_HEIGHT) and b == round(60 * GiB / top * PLOT_HEIGHT)
    assert abs(b / a - 2.0) < 0.02  # 60 GiB is twice 30 GiB
    line_y = geometry["limit_y"]
    assert tuple(rgb[(line_y * width + geometry["axis_x"] + 5) * 3:][:3]) == LIMIT
    assert round((geometry["base"] - line_y) / PLOT_HEIGHT * top / GiB) == 50


def test_a_zero_figure_draws_no_bar_and_a_small_one_keeps_a_pixel(plan_pp4, tmp_path):
    real = dataclasses.replace(plan_pp4, predicted=Prediction(
        step_seconds=1.0, tflops_per_device=1.0, memory_bytes_per_device=(0, 1024)))
    path = write_memory_png(real, tmp_path / "m.png")
    width, _, rows = read_png(path.read_bytes())
    rgb = b"".join(rows)
    geometry = layout(real)
    plot = range(geometry["plot_top"], geometry["base"])
    (x0, _, x1, _), (x0b, _, x1b, _) = geometry["bars"]
    assert _column_height(width, rgb, (x0 + x1) // 2, BAR, plot) == 0  # zero bytes draws no bar
    assert _column_height(width, rgb, (x0b + x1b) // 2, BAR, plot) == 1  # 1 KiB of 50 GiB still shows
    assert [value for value, _, _ in geometry["values"]] == ["0 B", "1.0 KiB"]


# --- text: each label's pixels are where the layout says --------------------------------------


def text_is_at(canvas: Canvas, text: str, x: int, y: int, colour) -> bool:
    """Whether the pixels of ``colour`` in the box ``text`` covers at (x, y) are exactly its glyphs'."""
    reference = Canvas(canvas.width, canvas.height, (1, 2, 3))
    reference.draw_text(x, y, text, colour, SCALE)
    width, height = text_size(text, SCALE)
    assert 0 <= x and x + width <= canvas.width and 0 <= y and y + height <= canvas.height, text
    return all((reference.pixel(i, j) == colour) == (canvas.pixel(i, j) == colour)
               for i in range(x, x + width) for j in range(y, y + height))


def test_the_picture_carries_its_title_axis_labels_values_and_legend(plan_pp4):
    canvas, geometry = draw_memory(plan_pp4), layout(plan_pp4)
    title, x, y = geometry["title"]
    assert title == "Predicted memory per device, by pipeline rank" and text_is_at(canvas, title, x, y, INK)
    subtitle, x, y = geometry["subtitle"]
    assert subtitle == "dp=2 x pp=2 x tp=1 on 4 cpu, 1f1b m=4, recompute none, fp32"
    assert text_is_at(canvas, subtitle, x, y, INK)
    assert not text_is_at(canvas, "Predicted memory per device, by pipeline rand", *geometry["title"][1:], INK)
    label, x, y = geometry["limit_label"]
    assert label == "usable 50.0 GiB" and text_is_at(canvas, label, x, y, LIMIT)
    assert abs(y + 7 - geometry["limit_y"]) <= 1  # the label is level with the line
    axis_x = geometry["axis_x"]
    for tick_y, tick in geometry["ticks"]:
        assert text_is_at(canvas, tick, axis_x - 8 - text_size(tick, SCALE)[0], tick_y - 7, INK)
    for rank, ((x0, y0, x1, _), (value, value_y, inside)) in enumerate(zip(geometry["bars"], geometry["values"])):
        assert value == ("30.0 GiB", "60.0 GiB")[rank] and not inside and value_y + 14 < y0
        assert text_is_at(canvas, value, x0 + (x1 - x0 - text_size(value, SCALE)[0]) // 2, value_y, INK)
        for line, text in enumerate(geometry["bar_labels"][rank]):
            assert text == (f"rank {rank}", f"stage {rank}")[line]
            assert text_is_at(canvas, text, x0 + (x1 - x0 - text_size(text, SCALE)[0]) // 2,
                              geometry["base"] + 10 + line * text_size(text, SCALE)[1], INK)
    words = ["fits in usable memory", "over usable memory", "usable memory: smallest limit of the stages"]
    for (x, y), text, colour in zip(geometry["legend"], words, (BAR, OVER, LIMIT)):
        assert text_is_at(canvas, text, x + 24, y + 1, INK) and canvas.pixel(x + 8, y + 8) == colour
    assert max(x + 24 + text_size(text, SCALE)[0] for (x, _), text in zip(geometry["legend"], words)) <= canvas.width


def test_a_value_the_limit_line_would_cross_goes_inside_its_bar(plan_pp4):
    near = dataclasses.replace(plan_pp4, predicted=dataclasses.replace(
        plan_pp4.predicted, memory_bytes_per_device=(49 * GiB, 51 * GiB)))
    canvas, geometry = draw_memory(near), layout(near)
    line = geometry["limit_y"]
    for (x0, y0, x1, y1), (value, value_y, inside) in zip(geometry["bars"], geometry["values"]):
        assert not value_y - 4 <= line <= value_y + 18  # the line never runs through a value
        colour = (255, 255, 255) if inside else INK
        assert text_is_at(canvas, value, x0 + (x1 - x0 - text_size(value, SCALE)[0]) // 2, value_y, colour)
    assert [inside for _, _, inside in geometry["values"]] == [True, False]  # 49 GiB: the line is just above
