"""The memory picture (matplotlib): a PNG of the size its layout asks for whose bars are as tall as
the plan's memory figures, to the pixel, with the limit line, and a figure that carries the title,
axis, values, rank labels and legend in words."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import xirang
from examples.gpt import build_gpt
from tests.codegen.png_reader import colours, read_png
from xirang.codegen.viz.memory_picture import (BAR, LIMIT, MEASURED, OVER, PLOT_HEIGHT, TITLE_MEASURED, draw_memory,
                                               memory_layout, render_memory_png, write_memory_png)
from xirang.ir.errors import XirangError
from xirang.ir.plan_parts import Prediction

GiB = 1024**3
WHITE = (255, 255, 255)


@pytest.fixture(scope="module")
def plan_pp4():
    torch.manual_seed(0)
    ids = torch.zeros(8, 32, dtype=torch.long)
    plan = xirang.plan(build_gpt("tiny"), world=4, hardware="cpu", example_kwargs={"input_ids": ids, "labels": ids},
                       global_batch=8, pp=2, dp=2)
    # memory figures chosen so the bars differ clearly and one crosses the limit
    memory = (30 * GiB, 60 * GiB)
    stages = tuple(dataclasses.replace(s, memory_limit_bytes=50 * GiB) for s in plan.stages)
    predicted = dataclasses.replace(plan.predicted, memory_bytes_per_device=memory)
    return dataclasses.replace(plan, predicted=predicted, stages=stages)


def with_memory(plan, *figures):
    return dataclasses.replace(plan, predicted=Prediction(step_seconds=1.0, tflops_per_device=1.0,
                                                          memory_bytes_per_device=tuple(figures)))


def picture(plan):
    """(layout, pixel(x, y) -> RGB, the set of colours) of the PNG drawn for ``plan``."""
    layout = memory_layout(plan)
    width, height, rows = read_png(render_memory_png(plan))
    assert (width, height) == (layout.width, layout.height)
    return layout, (lambda x, y: tuple(rows[y][3 * x:3 * x + 3])), colours(rows)


def column_height(pixel, layout, x, colour) -> int:
    return sum(pixel(x, y) == colour for y in range(layout.plot_top, layout.base))


def bar_top(pixel, layout, x, colour) -> int:
    return min(y for y in range(layout.plot_top, layout.base) if pixel(x, y) == colour)


def test_bars_are_proportional_to_memory_and_the_limit_is_drawn(plan_pp4, tmp_path):
    path = write_memory_png(plan_pp4, tmp_path / "mem.png")
    assert path == (tmp_path / "mem.png").resolve()
    layout, pixel, seen = picture(plan_pp4)
    assert read_png(path.read_bytes())[:2] == (layout.width, layout.height)
    # 60 GiB x 1.1 = 66 GiB of room: ticks every 20 GiB, so the scale ends on the 80 GiB tick
    assert layout.ticks == (0, 20, 40, 60, 80) and layout.top_bytes == 80 * GiB
    (a0, a1), (b0, b1) = layout.bar(0), layout.bar(1)
    # rank 0 fits (blue), rank 1 does not (orange); a bar's height runs from the x axis to its top row
    a = layout.base - bar_top(pixel, layout, (a0 + a1) // 2, BAR)
    b = layout.base - bar_top(pixel, layout, (b0 + b1) // 2, OVER)
    assert abs(a - 30 / 80 * PLOT_HEIGHT) <= 1 and abs(b - 60 / 80 * PLOT_HEIGHT) <= 1, (a, b)
    assert abs(b / a - 2.0) < 0.02  # 60 GiB is twice 30 GiB
    line = round(layout.y(50 * GiB))
    assert 1 <= sum(pixel((b0 + b1) // 2, y) == LIMIT for y in range(line - 3, line + 4)) <= 3  # over the bar
    assert pixel((a0 + a1) // 2, layout.base - 2) == BAR and pixel((b0 + b1) // 2, layout.base - 2) == OVER
    assert pixel((a0 + a1) // 2, round(layout.y(30 * GiB)) - 3) != BAR  # nothing above the bar's top
    # the limit line runs across the plot left of the bars, at 50 GiB
    assert any(pixel(layout.left + 5, y) == LIMIT for y in range(line - 1, line + 2))
    assert {BAR, OVER, LIMIT, WHITE} <= seen and len(seen) > 20


def test_a_zero_figure_draws_no_bar_and_a_small_one_keeps_a_pixel(plan_pp4):
    layout, pixel, seen = picture(with_memory(plan_pp4, 0, 1024))
    (x0, x1), (y0, y1) = layout.bar(0), layout.bar(1)
    assert column_height(pixel, layout, (x0 + x1) // 2, BAR) == 0  # zero bytes draws no bar
    assert column_height(pixel, layout, (y0 + y1) // 2, BAR) == 1  # 1 KiB of 50 GiB still shows
    assert [value for value, _ in layout.values] == ["0 B", "1.0 KiB"]


def test_the_figure_carries_its_title_axis_labels_values_and_legend(plan_pp4):
    figure = draw_memory(plan_pp4)
    title, subtitle = (t.get_text() for t in figure.texts)
    assert title == "Predicted memory per device, by pipeline rank"
    assert subtitle == "dp=2 x pp=2 x tp=1 on 4 cpu, zb-h1 m=4, recompute none, fp32"
    (axes,) = figure.axes
    assert axes.get_ylabel() == "GiB per device"
    assert [t.get_text() for t in axes.get_yticklabels()] == ["0", "20", "40", "60", "80"]
    assert [t.get_text() for t in axes.get_xticklabels()] == ["rank 0\nstage 0", "rank 1\nstage 1"]
    texts = [t.get_text() for t in axes.texts]
    assert "  usable 50.0 GiB" in texts and "30.0 GiB" in texts and "60.0 GiB" in texts
    words = [t.get_text() for t in figure.legends[0].get_texts()]
    assert words == ["fits in usable memory", "over usable memory", "usable memory: smallest limit of the stages"]
    renderer = figure.canvas.get_renderer()
    for artist in [*figure.texts, *axes.texts, figure.legends[0]]:  # nothing is cut off at the edges
        box = artist.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= figure.bbox.width and 0 <= box.y0 and box.y1 <= figure.bbox.height, artist


def test_a_value_the_limit_line_would_cross_goes_inside_its_bar(plan_pp4):
    near = dataclasses.replace(plan_pp4, predicted=dataclasses.replace(
        plan_pp4.predicted, memory_bytes_per_device=(49 * GiB, 51 * GiB)))
    layout = memory_layout(near)
    assert layout.values == (("49.0 GiB", True), ("51.0 GiB", False))  # 49 GiB: the line is just above
    figure = draw_memory(near)
    renderer = figure.canvas.get_renderer()
    line = figure.bbox.height - layout.y(50 * GiB)  # the line's height in display pixels (from the bottom)
    values = {t.get_text(): t for t in figure.axes[0].texts}
    for value, _ in layout.values:
        box = values[value].get_window_extent(renderer)
        assert not box.y0 - 1 <= line <= box.y1 + 1, value  # the line never runs through a value
    assert values["49.0 GiB"].get_color() == (1.0, 1.0, 1.0)


def test_the_folder_must_exist(plan_pp4, tmp_path):
    with pytest.raises(XirangError, match="does not exist") as error:
        write_memory_png(plan_pp4, tmp_path / "missing" / "mem.png")
    assert error.value.where == "--picture"


def test_measured_figures_are_markers_across_the_bars(plan_pp4):
    """A run's figures (xirang run --memory-picture) cross each predicted bar at the measured bytes;
    the scale makes room for a measurement above every bar; the legend says what was measured."""
    measured = (25 * GiB, 70 * GiB)
    layout = memory_layout(plan_pp4, measured, "allocator peak")
    assert layout.top_bytes >= 1.1 * 70 * GiB
    width, height, rows = read_png(render_memory_png(plan_pp4, measured, "allocator peak"))
    assert (width, height) == (layout.width, layout.height)

    def pixel(x, y):
        return tuple(rows[y][3 * x:3 * x + 3])
    for rank, nbytes in enumerate(measured):
        x0, x1 = layout.bar(rank)
        row = round(layout.y(nbytes))
        assert any(pixel((x0 + x1) // 2, y) == MEASURED for y in range(row - 2, row + 3)), rank
        assert not any(pixel((x0 + x1) // 2, y) == MEASURED for y in range(layout.plot_top, row - 4)), rank
    figure = draw_memory(plan_pp4, measured, "allocator peak")
    assert figure.texts[0].get_text() == TITLE_MEASURED
    assert "measured: allocator peak" in [t.get_text() for t in figure.legends[0].get_texts()]
    with pytest.raises(ValueError, match="pipeline ranks"):
        memory_layout(plan_pp4, (GiB,))

