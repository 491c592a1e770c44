"""The timeline picture (matplotlib): the PNG has the size its layout asks for, every action's box
is where the layout says in its kind's colour, idle time is grey, and the figure carries the title,
row labels, time axis, micro-batch numbers and legend in words."""
from __future__ import annotations

import sys

import pytest

from tests.codegen.png_reader import colours, read_png
from xirang.codegen.runtime.executor.schedule_sim import simulate, simulated_bubble
from xirang.codegen.viz.timeline import (CHUNK_COLOURS, IDLE, KIND_COLOURS, STRIP, action_colour, axis_title,
                                         legend_items, render_timeline, render_timeline_png, row_label,
                                         timeline_layout, timeline_title, write_timeline_png)
from xirang.ir.errors import XirangError
from xirang.ir.schedules import (Backward, BackwardInput, BackwardWeight, Forward, gpipe, interleaved_one_f_one_b,
                                 is_compute, one_f_one_b, with_communication)


def split_backward_timeline():
    orders = [[c for a in actions if is_compute(a)
               for c in ((BackwardInput(a.stage, a.micro_batch), BackwardWeight(a.stage, a.micro_batch))
                         if isinstance(a, Backward) else (a,))] for actions in one_f_one_b(3, 4).ranks]
    return simulate(with_communication("zb-like", 3, 4, orders))


def picture(timeline, **options):
    """(layout, pixel(x, y) -> RGB, the set of colours) of the PNG drawn for ``timeline``."""
    layout = timeline_layout(timeline, **options)
    width, height, rows = read_png(render_timeline_png(timeline, **options))
    assert (width, height) == (layout.width, layout.height)
    return layout, (lambda x, y: tuple(rows[y][3 * x:3 * x + 3])), colours(rows)


@pytest.mark.parametrize("timeline", [simulate(one_f_one_b(4, 8)), simulate(interleaved_one_f_one_b(4, 8, 2)),
                                      simulate(gpipe(3, 5)), split_backward_timeline()],
                         ids=["1f1b", "interleaved", "gpipe", "split-backward"])
def test_every_box_is_drawn_where_the_layout_says_in_its_colour(timeline):
    layout, pixel, seen = picture(timeline)
    strip = STRIP if timeline.schedule.virtual_stages > 1 else 0
    for entry in timeline.entries:
        x0, y0, x1, y1 = layout.box(entry)
        # the box spans its time (less one pixel of gap) on its rank's row
        assert (y0, y1) == (layout.top + entry.rank * 34, layout.top + entry.rank * 34 + 28)
        assert abs(x0 - (layout.left + float(entry.start) * layout.pixels_per_unit)) <= 0.5
        assert abs(x1 + 1 - (layout.left + float(entry.end) * layout.pixels_per_unit)) <= 0.5
        fill = action_colour(entry.action)
        # the four corners under the strip are the fill; the pixel right of the box is not (a gap)
        for x, y in ((x0, y0 + strip), (x1 - 1, y0 + strip), (x0, y1 - 1), (x1 - 1, y1 - 1)):
            assert pixel(x, y) == fill, (entry, x, y)
        assert pixel(x1, (y0 + y1) // 2) != fill and pixel(x0 + 2, y1) != fill, entry
        if strip:
            chunk = entry.action.stage // timeline.schedule.pipeline_ranks
            assert pixel((x0 + x1) // 2, y0 + 1) == CHUNK_COLOURS[chunk], entry
    kinds = {type(e.action) for e in timeline.entries}
    assert {KIND_COLOURS[kind] for kind in kinds} <= seen  # micro-batch 0 is drawn in the kind's own colour
    assert IDLE in seen and (255, 255, 255) in seen
    assert len(seen) > 20  # boxes, shades, anti-aliased text: far from blank


def test_idle_time_is_grey_and_outside_the_rows_is_white():
    timeline = simulate(one_f_one_b(4, 8))
    layout, pixel, _ = picture(timeline)
    # Rank 0 waits from t=4 (its warm-up done) to t=10 (micro-batch 0's gradient is back).
    assert pixel(layout.x(7), layout.row_top(0) + 5) == IDLE
    assert pixel(layout.x(7), layout.row_top(0) - 2) == (255, 255, 255)  # the gap above the row
    assert pixel(layout.x(33) + 3, layout.row_top(3) + 5) == (255, 255, 255)  # after the makespan


def test_the_size_follows_the_pixels_asked_for_per_time_unit():
    timeline = simulate(one_f_one_b(4, 8))  # makespan 33
    small, _, _ = picture(timeline, pixels_per_unit=20)
    large, _, _ = picture(timeline, pixels_per_unit=40)
    assert (small.plot_width, large.plot_width) == (660, 1320)
    assert large.width - small.width == 660 and large.height == small.height
    assert timeline_layout(timeline).plot_width == 1200  # about 1200 pixels of time by default


def test_1f1b_figure_has_its_title_row_labels_axis_numbers_and_legend():
    timeline = simulate(one_f_one_b(4, 8))
    figure = render_timeline(timeline)
    title = timeline_title(timeline)
    assert title == "1F1B schedule: p=4 pipeline ranks, m=8 micro-batches, simulated bubble 27.3%"  # 3/11
    assert [t.get_text() for t in figure.texts] == [title]
    (axes,) = figure.axes
    assert [t.get_text() for t in axes.get_yticklabels()] == [f"rank {r}: stage {r}" for r in range(4)]
    assert [row_label(timeline.schedule, r) for r in range(4)] == [f"rank {r}: stage {r}" for r in range(4)]
    assert axes.get_xlabel() == axis_title(timeline) == (
        "time (simulated units; forward 1, backward 2 per micro-batch and stage)")
    assert [float(t) for t in axes.get_xticks() if 0 <= t <= 33] == list(range(0, 33, 2))
    numbers = sorted(int(t.get_text()) for t in axes.texts)  # one number in every box (all fit at 36 px a unit)
    assert numbers == sorted(e.action.micro_batch for e in timeline.entries)
    (legend,) = figure.legends
    words = [t.get_text() for t in legend.get_texts()]
    assert sorted(words) == sorted(["forward", "backward", "idle (bubble)",
                                    "number in a box: micro-batch (later ones lighter)"])
    assert legend_items(timeline)[0][1] == (KIND_COLOURS[Forward], None)


def test_interleaved_figure_names_v_and_the_chunk_strips():
    timeline = simulate(interleaved_one_f_one_b(4, 8, 2))
    figure = render_timeline(timeline)
    bubble = float(simulated_bubble(timeline.schedule).overall)
    assert figure.texts[0].get_text() == (f"interleaved 1F1B schedule: p=4 pipeline ranks, v=2 chunks per rank, "
                                          f"m=8 micro-batches, simulated bubble {bubble:.1%}")
    assert figure.axes[0].get_yticklabels()[1].get_text() == "rank 1: stages 1,5"
    words = [t.get_text() for t in figure.legends[0].get_texts()]
    assert "top strip: chunk 0 (stages 0-3)" in words and "top strip: chunk 1 (stages 4-7)" in words


def test_split_backward_figure_names_input_and_weight_parts():
    timeline = split_backward_timeline()
    figure = render_timeline(timeline)
    assert figure.texts[0].get_text().startswith("zb-like schedule: p=3 pipeline ranks, m=4 micro-batches")
    words = [t.get_text() for t in figure.legends[0].get_texts()]
    assert {"forward", "backward, input part", "backward, weight part", "idle (bubble)"} <= set(words)
    assert "backward" not in words
    assert "backward-input 1, backward-weight 1" in axis_title(timeline)


def test_the_legend_fits_the_picture():
    for timeline in (simulate(gpipe(2, 1)), simulate(interleaved_one_f_one_b(4, 8, 2))):
        layout = timeline_layout(timeline)
        figure = render_timeline(timeline)
        box = figure.legends[0].get_window_extent(figure.canvas.get_renderer())
        assert 0 <= box.x0 and box.x1 <= layout.width and 0 <= box.y0  # y from the bottom: not cut off
        assert layout.height - box.y1 >= layout.legend_top - 1  # under the time axis


def test_write_timeline_png_writes_the_file_and_says_when_the_folder_is_missing(tmp_path):
    timeline = simulate(gpipe(2, 2))
    path = write_timeline_png(timeline, tmp_path / "t.png")
    width, height, _ = read_png(path.read_bytes())
    assert (width, height) == (timeline_layout(timeline).width, timeline_layout(timeline).height)
    with pytest.raises(XirangError, match="does not exist"):
        write_timeline_png(timeline, tmp_path / "missing" / "t.png")


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(XirangError, match=r'pip install "xirang\[viz\]"'):
        write_timeline_png(simulate(gpipe(2, 3)), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
