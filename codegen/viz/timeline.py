"""Print a schedule as text, one line per rank, and draw a simulated timeline as a PNG picture.

Text tokens: ``F3`` forward of micro-batch 3, ``B3`` its backward, ``BI3``/``BW3`` the input and
weight parts of a split backward. On a rank holding several stages (interleaved) the stage is added:
``F3@s5``. With ``communication=True`` transfers appear too: ``Sa3>r1`` sends micro-batch 3's
activation to rank 1, ``Rg3<r2`` receives its gradient from rank 2.

Picture (5x7 font of ``font_5x7`` at scale 2): a title with the schedule, p, m, v when interleaved
and the simulated bubble; one row per pipeline rank, labelled "rank r: stage s" on the left, time to
the right on an axis with tick labels and a title giving the unit; grey is idle (the bubble). Each
compute action is a box coloured by kind (forward blue, backward green, split input/weight backward
amber/red), lighter for later micro-batches, with its micro-batch number inside when it fits (black
or white, whichever reads better on the fill). On ranks holding several stages a strip along the top
of a box gives the chunk (dark: first chunk, then magenta, orange, teal...). A legend below names
every colour in words and wraps to the picture's width.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import cycle
from pathlib import Path

from xirang.codegen.viz.font_5x7 import GLYPH_HEIGHT, printable
from xirang.codegen.viz.png_canvas import Canvas, Colour, text_size
from xirang.codegen.runtime.schedule_sim import TimedAction, Timeline, idle_fractions
from xirang.ir.schedules import (ACTIVATION, Action, Backward, BackwardInput, BackwardWeight, Forward, Recv, Schedule, Send)

KIND_COLOURS: dict[type, Colour] = {Forward: (66, 133, 244), Backward: (52, 168, 83),
                                    BackwardInput: (244, 180, 0), BackwardWeight: (219, 68, 55)}
KIND_LETTERS = {Forward: "F", Backward: "B", BackwardInput: "BI", BackwardWeight: "BW"}
CHUNK_COLOURS: tuple[Colour, ...] = ((40, 40, 40), (200, 0, 200), (255, 120, 0), (0, 150, 150))
IDLE, BACKGROUND, INK = (225, 225, 225), (255, 255, 255), (0, 0, 0)
MICRO_BATCH_SHADES = 6  # lightness cycles every 6 micro-batches so neighbours stay distinguishable
KIND_NAMES = {Forward: "forward", Backward: "backward", BackwardInput: "backward, input part",
              BackwardWeight: "backward, weight part"}
DURATION_NAMES = {Forward: "forward", Backward: "backward", BackwardInput: "backward-input",
                  BackwardWeight: "backward-weight"}
SCHEDULE_TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}
TEXT = 2  # font scale of every label: 12 x 14 pixels a character
MARGIN, ROW_HEIGHT, ROW_GAP, STRIP = 16, 28, 6, 4
SWATCH, LEGEND_LINE = 16, 26  # legend box side; legend line pitch
LINE = text_size("A", TEXT)[1]  # height of a line of text, descent included (18)
CAP = GLYPH_HEIGHT * TEXT  # height of a capital or digit (14)


def _token(action: Action, schedule: Schedule) -> str:
    several = schedule.virtual_stages > 1
    at = f"@s{action.stage}" if several else ""
    if isinstance(action, (Send, Recv)):
        arrow = ">" if isinstance(action, Send) else "<"
        kind = "a" if action.kind == ACTIVATION else "g"
        return f"{type(action).__name__[0]}{kind}{action.micro_batch}{at}{arrow}r{action.peer}"
    return f"{KIND_LETTERS[type(action)]}{action.micro_batch}{at}"


def format_schedule(schedule: Schedule, *, communication: bool = False) -> str:
    """One line per rank: ``rank 0 (stage 0): F0 F1 B0 F2 B1 B2``; see the module docstring."""
    lines = []
    for rank, actions in enumerate(schedule.ranks):
        stages = schedule.stages_of(rank)
        header = f"rank {rank} (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}):"
        tokens = [_token(a, schedule) for a in actions if communication or not isinstance(a, (Send, Recv))]
        lines.append(" ".join([header, *tokens]))
    return "\n".join(lines)


def action_colour(action: Action) -> Colour:
    """Fill colour of a compute action: its kind's colour mixed towards white by micro-batch."""
    base = KIND_COLOURS[type(action)]
    lighten = (action.micro_batch % MICRO_BATCH_SHADES) / (MICRO_BATCH_SHADES * 1.6)
    return tuple(round(c + (255 - c) * lighten) for c in base)


def _ink_on(fill: Colour) -> Colour:
    """Black or white, whichever contrasts more with ``fill`` (ITU-R BT.601 luma)."""
    luma = 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]
    return INK if luma >= 140 else (255, 255, 255)


def _number(value) -> str:
    return f"{float(value):g}"


def timeline_title(timeline: Timeline) -> str:
    """E.g. "1F1B schedule: p=4 pipeline ranks, m=8 micro-batches, simulated bubble 27.3%"."""
    schedule = timeline.schedule
    name = SCHEDULE_TITLES.get(schedule.name, printable(schedule.name))
    chunks = f", v={schedule.virtual_stages} chunks per rank" if schedule.virtual_stages > 1 else ""
    p, m = schedule.pipeline_ranks, schedule.num_micro_batches
    title = (f"{name} schedule: p={p} pipeline rank{'s' * (p != 1)}{chunks}, "
             f"m={m} micro-batch{'es' * (m != 1)}")
    if timeline.entries and timeline.makespan:
        bubble = idle_fractions(timeline.entries, pipeline_ranks=schedule.pipeline_ranks).overall
        title += f", simulated bubble {float(bubble):.1%}"
    return title


def row_label(schedule: Schedule, rank: int) -> str:
    stages = schedule.stages_of(rank)
    if len(stages) == 1:
        return f"rank {rank}: stage {stages[0]}"
    shown = stages if len(stages) <= 3 else (stages[0], stages[1], "..", stages[-1])
    return f"rank {rank}: stages {','.join(map(str, shown))}"


def axis_title(timeline: Timeline) -> str:
    """The time axis' title; it gives each kind's duration when all actions of a kind take the same."""
    durations: dict[type, set] = {}
    for entry in timeline.entries:
        durations.setdefault(type(entry.action), set()).add(entry.end - entry.start)
    each = [f"{DURATION_NAMES[kind]} {_number(next(iter(times)))}"
            for kind, times in durations.items() if len(times) == 1]
    if len(each) < len(durations):
        return "time (simulated units)"
    return f"time (simulated units; {', '.join(each)} per micro-batch and stage)"


def legend_items(timeline: Timeline) -> list[tuple[str, tuple[Colour, Colour | None]]]:
    """(words, (box colour, top strip colour or None)); an entry with no box colour is a plain note."""
    kinds = [kind for kind in KIND_COLOURS if any(type(e.action) is kind for e in timeline.entries)]
    items = [(KIND_NAMES[kind], (KIND_COLOURS[kind], None)) for kind in kinds]
    items.append(("idle (bubble)", (IDLE, None)))
    schedule = timeline.schedule
    if schedule.virtual_stages > 1:
        p = schedule.pipeline_ranks
        items += [(f"top strip: chunk {chunk} (stages {chunk * p}-{chunk * p + p - 1})",
                   (IDLE, CHUNK_COLOURS[chunk % len(CHUNK_COLOURS)])) for chunk in range(schedule.virtual_stages)]
    items.append(("number in a box: micro-batch (later ones lighter)", (None, None)))
    return items


def _legend_item_width(words: str, swatch: bool = True) -> int:
    return (SWATCH + 8 if swatch else 0) + text_size(words, TEXT)[0] + 24  # box, gap, words, gap


@dataclass(frozen=True)
class TimelineLayout:
    """Where everything goes in the picture, so tests (and readers) can find an action's pixels."""

    pixels_per_unit: float
    left: int  # x of time 0
    top: int  # y of rank 0's row
    row_height: int
    row_gap: int
    ranks: int
    width: int
    height: int
    axis_top: int = 0  # y of the time axis line
    legend_top: int = 0
    legend: tuple[tuple[int, int], ...] = ()  # top-left (x, y) of each of legend_items(), wrapped
    tick_step: float = 1.0
    title_top: int = MARGIN

    def row_top(self, rank: int) -> int:
        return self.top + rank * (self.row_height + self.row_gap)

    def x(self, time) -> int:
        return self.left + round(float(time) * self.pixels_per_unit)

    def box(self, entry: TimedAction) -> tuple[int, int, int, int]:
        """Half-open (x0, y0, x1, y1) filled for ``entry``; one pixel is left free at its right end
        so that back-to-back actions stay apart."""
        y0 = self.row_top(entry.rank)
        x0, x1 = self.x(entry.start), self.x(entry.end)
        return x0, y0, max(x0 + 1, x1 - 1), y0 + self.row_height


def _tick_step(makespan: float, pixels_per_unit: float) -> float:
    """The smallest 1-2-5 step whose tick labels stay at least 3 characters' width apart."""
    widest = text_size(_number(makespan), TEXT)[0] + 3 * 12
    step, ladder = 1.0, cycle((2, 2.5, 2))  # 1, 2, 5, 10, 20, 50, ...
    while step * pixels_per_unit < widest:
        step *= next(ladder)
    return step


def _wrap(widths: list[int], room: int, top: int) -> tuple[tuple[int, int], ...]:
    """Top-left corners of legend entries laid left to right, a new line when ``room`` is used up."""
    places, x, y = [], MARGIN, top
    for width in widths:
        if x > MARGIN and x - MARGIN + width > room:
            x, y = MARGIN, y + LEGEND_LINE
        places.append((x, y))
        x += width
    return tuple(places)


def timeline_layout(timeline: Timeline, *, pixels_per_unit: float | None = None) -> TimelineLayout:
    """Size the picture: about 1200 pixels of time unless ``pixels_per_unit`` is given."""
    makespan = float(timeline.makespan) or 1.0
    scale = pixels_per_unit or max(4.0, min(48.0, 1200 / makespan))
    ranks = timeline.schedule.pipeline_ranks
    left = MARGIN + max(text_size(row_label(timeline.schedule, r), TEXT)[0] for r in range(ranks)) + 12
    top = MARGIN + LINE + 12  # below the title
    plot_right = left + round(makespan * scale)
    widths = [_legend_item_width(words, colours[0] is not None) for words, colours in legend_items(timeline)]
    room = max(plot_right, MARGIN + text_size(timeline_title(timeline), TEXT)[0],
               text_size(axis_title(timeline), TEXT)[0] + left, MARGIN + max(widths)) - MARGIN
    axis_top = top + ranks * (ROW_HEIGHT + ROW_GAP) - ROW_GAP + 4
    legend_top = axis_top + 10 + LINE + 6 + LINE + 14  # tick, tick labels, axis title, gap
    legend = _wrap(widths, room, legend_top)
    height = legend[-1][1] + LINE + MARGIN
    return TimelineLayout(scale, left, top, ROW_HEIGHT, ROW_GAP, ranks, MARGIN + room + MARGIN, height,
                          axis_top, legend_top, legend, _tick_step(makespan, scale))


def render_timeline(timeline: Timeline, *, pixels_per_unit: float | None = None) -> Canvas:
    """Draw ``timeline`` (see the module docstring) on a new Canvas."""
    layout = timeline_layout(timeline, pixels_per_unit=pixels_per_unit)
    schedule = timeline.schedule
    canvas = Canvas(layout.width, layout.height, BACKGROUND)
    canvas.draw_text(MARGIN, layout.title_top, timeline_title(timeline), INK, TEXT)
    for rank in range(layout.ranks):
        top = layout.row_top(rank)
        canvas.fill_rect(layout.left, top, layout.x(timeline.makespan), top + layout.row_height, IDLE)
        canvas.draw_text(MARGIN, top + (layout.row_height - CAP) // 2, row_label(schedule, rank), INK, TEXT)
    for entry in timeline.entries:
        x0, y0, x1, y1 = layout.box(entry)
        fill = action_colour(entry.action)
        canvas.fill_rect(x0, y0, x1, y1, fill)
        strip = 0
        if schedule.virtual_stages > 1:
            chunk = entry.action.stage // schedule.pipeline_ranks
            canvas.fill_rect(x0, y0, x1, y0 + STRIP, CHUNK_COLOURS[chunk % len(CHUNK_COLOURS)])
            strip = STRIP
        label = str(entry.action.micro_batch)
        for scale in (TEXT, 1):  # the largest label that leaves 2 pixels either side
            width, height = text_size(label, scale)[0], GLYPH_HEIGHT * scale  # digits have no descent
            if width <= x1 - x0 - 4:
                canvas.draw_text(x0 + (x1 - x0 - width) // 2, y0 + strip + (y1 - y0 - strip - height) // 2,
                                 label, _ink_on(fill), scale)
                break
    _draw_time_axis(canvas, layout, timeline)
    _draw_legend(canvas, layout, timeline)
    return canvas


def _draw_time_axis(canvas: Canvas, layout: TimelineLayout, timeline: Timeline) -> None:
    y, makespan = layout.axis_top, float(timeline.makespan)
    canvas.fill_rect(layout.left, y, layout.x(makespan) + 1, y + 1, INK)
    tick, count = layout.tick_step, int(makespan / layout.tick_step + 1e-9)
    for index in range(count + 1):
        x, label = layout.x(index * tick), _number(index * tick)
        canvas.fill_rect(x, y, x + 1, y + 6, INK)
        width = text_size(label, TEXT)[0]
        canvas.draw_text(min(max(x - width // 2, layout.left - 6), canvas.width - MARGIN - width), y + 10,
                         label, INK, TEXT)
    canvas.draw_text(layout.left, y + 10 + LINE + 6, axis_title(timeline), INK, TEXT)


def _draw_legend(canvas: Canvas, layout: TimelineLayout, timeline: Timeline) -> None:
    for (words, (box, strip)), (x, y) in zip(legend_items(timeline), layout.legend):
        if box is not None:  # a swatch, framed so that the light grey of idle shows on white
            canvas.fill_rect(x, y, x + SWATCH, y + SWATCH, box)
            if strip is not None:
                canvas.fill_rect(x, y, x + SWATCH, y + STRIP, strip)
            canvas.outline_rect(x, y, x + SWATCH, y + SWATCH, (150, 150, 150))
        canvas.draw_text(x + (SWATCH + 8 if box is not None else 0), y + 1, words, INK, TEXT)


def render_timeline_png(timeline: Timeline, *, pixels_per_unit: float | None = None) -> bytes:
    return render_timeline(timeline, pixels_per_unit=pixels_per_unit).to_png()


def write_timeline_png(timeline: Timeline, path, *, pixels_per_unit: float | None = None) -> Path:
    """Write the timeline picture to ``path`` and return it as a Path."""
    path = Path(path)
    path.write_bytes(render_timeline_png(timeline, pixels_per_unit=pixels_per_unit))
    return path
