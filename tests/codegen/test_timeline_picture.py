"""The timeline picture's words: title, row labels, time axis, legend and micro-batch numbers, each
found at the place the layout gives by drawing the same words alone and comparing the pixels."""
from __future__ import annotations

from xirang.codegen.viz.png_canvas import Canvas, text_size
from xirang.codegen.runtime.schedule_sim import simulate, simulated_bubble
from xirang.ir.schedules import (Backward, BackwardInput, BackwardWeight, Forward, interleaved_one_f_one_b,
                                      is_compute, one_f_one_b, with_communication)
from xirang.codegen.viz.timeline import (CAP, INK, KIND_COLOURS, LINE, MARGIN, SWATCH, TEXT, action_colour, axis_title,
                                     legend_items, render_timeline, row_label, timeline_layout, timeline_title)


def text_is_at(canvas: Canvas, text: str, x: int, y: int, colour=INK, scale: int = TEXT) -> bool:
    """Whether the pixels of ``colour`` in the box ``text`` covers at (x, y) are exactly its glyphs'."""
    reference = Canvas(canvas.width, canvas.height, (1, 2, 3))
    reference.draw_text(x, y, text, colour, scale)
    width, height = text_size(text, scale)
    assert 0 <= x and x + width <= canvas.width and 0 <= y and y + height <= canvas.height, f"{text!r} is cut off"
    return all((reference.pixel(i, j) == colour) == (canvas.pixel(i, j) == colour)
               for i in range(x, x + width) for j in range(y, y + height))


def test_1f1b_picture_has_its_title_row_labels_and_time_axis():
    timeline = simulate(one_f_one_b(4, 8))
    canvas, layout = render_timeline(timeline), timeline_layout(timeline)
    title = timeline_title(timeline)
    assert title == "1F1B schedule: p=4 pipeline ranks, m=8 micro-batches, simulated bubble 27.3%"  # 3/11
    assert text_is_at(canvas, title, MARGIN, layout.title_top)
    assert not text_is_at(canvas, title.replace("27.3", "27.4"), MARGIN, layout.title_top)
    for rank in range(4):
        assert row_label(timeline.schedule, rank) == f"rank {rank}: stage {rank}"
        assert text_is_at(canvas, f"rank {rank}: stage {rank}", MARGIN, layout.row_top(rank) + (28 - CAP) // 2)
        assert MARGIN + text_size(f"rank {rank}: stage {rank}", TEXT)[0] < layout.left  # clear of the boxes
    assert layout.tick_step == 2  # 36 pixels a unit; "33" is 22 pixels wide plus 3 characters of room
    for tick in range(0, 33, 2):
        label = str(tick)
        x = max(layout.x(tick) - text_size(label, TEXT)[0] // 2, layout.left - 6)
        assert text_is_at(canvas, label, x, layout.axis_top + 10), tick
    assert axis_title(timeline) == "time (simulated units; forward 1, backward 2 per micro-batch and stage)"
    assert text_is_at(canvas, axis_title(timeline), layout.left, layout.axis_top + 10 + LINE + 6)
    assert layout.row_top(3) + 28 < layout.axis_top < layout.legend_top  # rows, axis, legend: no overlap


def test_micro_batch_numbers_are_written_inside_their_boxes():
    timeline = simulate(one_f_one_b(4, 8))
    canvas, layout = render_timeline(timeline), timeline_layout(timeline)
    for action in (Backward(2, 3), Forward(0, 1), Forward(3, 7)):
        entry = next(e for e in timeline.entries if e.action == action)
        x0, y0, x1, y1 = layout.box(entry)
        width = text_size(str(action.micro_batch), TEXT)[0]
        fill = action_colour(action)
        ink = INK if 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2] >= 140 else (255, 255, 255)
        assert text_is_at(canvas, str(action.micro_batch), x0 + (x1 - x0 - width) // 2, y0 + (y1 - y0 - CAP) // 2,
                          ink), action
        assert canvas.pixel(x0 + 1, y0 + 1) == fill


def _legend_is_drawn(canvas: Canvas, timeline, layout) -> list[str]:
    words = []
    for (text, (box, strip)), (x, y) in zip(legend_items(timeline), layout.legend):
        assert text_is_at(canvas, text, x + (SWATCH + 8 if box is not None else 0), y + 1), text
        if box is not None:
            assert canvas.pixel(x + SWATCH // 2, y + SWATCH - 3) == box
            assert strip is None or canvas.pixel(x + SWATCH // 2, y + 2) == strip
        assert x + text_size(text, TEXT)[0] <= layout.width - MARGIN  # inside the picture
        words.append(text)
    return words


def test_the_legend_names_every_colour_in_words():
    timeline = simulate(one_f_one_b(4, 8))
    words = _legend_is_drawn(render_timeline(timeline), timeline, timeline_layout(timeline))
    assert words == ["forward", "backward", "idle (bubble)", "number in a box: micro-batch (later ones lighter)"]
    assert legend_items(timeline)[0][1] == (KIND_COLOURS[Forward], None)


def test_interleaved_picture_names_v_and_the_chunk_strips():
    timeline = simulate(interleaved_one_f_one_b(4, 8, 2))
    canvas, layout = render_timeline(timeline), timeline_layout(timeline)
    bubble = float(simulated_bubble(timeline.schedule).overall)
    title = timeline_title(timeline)
    assert title == (f"interleaved 1F1B schedule: p=4 pipeline ranks, v=2 chunks per rank, m=8 micro-batches, "
                     f"simulated bubble {bubble:.1%}")
    assert text_is_at(canvas, title, MARGIN, layout.title_top)
    assert text_is_at(canvas, "rank 1: stages 1,5", MARGIN, layout.row_top(1) + (28 - CAP) // 2)
    words = _legend_is_drawn(canvas, timeline, layout)
    assert "top strip: chunk 0 (stages 0-3)" in words and "top strip: chunk 1 (stages 4-7)" in words
    assert len({y for _, y in layout.legend}) == 2  # too long for one line: wrapped, not cut off


def test_split_backward_picture_names_input_and_weight_parts():
    orders = [[c for a in actions if is_compute(a)
               for c in ((BackwardInput(a.stage, a.micro_batch), BackwardWeight(a.stage, a.micro_batch))
                         if isinstance(a, Backward) else (a,))] for actions in one_f_one_b(3, 4).ranks]
    timeline = simulate(with_communication("zb-like", 3, 4, orders))
    canvas, layout = render_timeline(timeline), timeline_layout(timeline)
    assert timeline_title(timeline).startswith("zb-like schedule: p=3 pipeline ranks, m=4 micro-batches")
    words = _legend_is_drawn(canvas, timeline, layout)
    assert words[:4] == ["forward", "backward, input part", "backward, weight part", "idle (bubble)"]
    assert "backward-input 1, backward-weight 1" in axis_title(timeline)
