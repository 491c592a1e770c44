"""Print a schedule as text, one line per rank, and draw a simulated timeline as a PNG picture.

Text tokens: ``F3`` forward of micro-batch 3, ``B3`` its backward, ``BI3``/``BW3`` the input and
weight parts of a split backward. On a rank holding several stages (interleaved) the stage is added:
``F3@s5``. With ``communication=True`` transfers appear too: ``Sa3>r1`` sends micro-batch 3's
activation to rank 1, ``Rg3<r2`` receives its gradient from rank 2.

Picture (matplotlib, the ``viz`` extra; see ``plotting``): a title with the schedule, p, m, v when
interleaved and the simulated bubble; one row per pipeline rank, labelled "rank r: stage s" on the
left, time to the right on an axis with ticks and a title giving the unit; grey is idle (the
bubble). Each compute action is a box coloured by kind (forward blue, backward green, split
input/weight backward amber/red), lighter for later micro-batches, with its micro-batch number
inside when it fits (black or white, whichever reads better on the fill). On ranks holding several
stages a strip along the top of a box gives the chunk (dark: first chunk, then magenta, orange,
teal...). A legend below names every colour in words, in as many columns as the width allows.

The axes are placed to the pixel (``timeline_layout``) and the boxes are drawn without
anti-aliasing, so an action's box in the PNG is exactly where ``TimelineLayout.box`` says, in
exactly ``action_colour``.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import cycle
from math import ceil
from pathlib import Path

from xirang.codegen.runtime.executor.schedule_sim import TimedAction, Timeline, idle_fractions
from xirang.codegen.viz.plotting import (DPI, FONT, TITLE_FONT, Colour, add_legend, fit_legend, new_figure, plain,
                                         png_bytes, rgb, text_size, write_png)
from xirang.ir.schedules import (ACTIVATION, SCHEDULE_SPECS, Action, Backward, BackwardInput, BackwardWeight, Forward,
                                 Recv, Schedule, Send)

KIND_COLOURS: dict[type, Colour] = {Forward: (66, 133, 244), Backward: (52, 168, 83),
                                    BackwardInput: (244, 180, 0), BackwardWeight: (219, 68, 55)}
KIND_LETTERS = {Forward: "F", Backward: "B", BackwardInput: "BI", BackwardWeight: "BW"}
CHUNK_COLOURS: tuple[Colour, ...] = ((40, 40, 40), (200, 0, 200), (255, 120, 0), (0, 150, 150))
IDLE, BACKGROUND, INK, WHITE, FRAME = (225, 225, 225), (255, 255, 255), (0, 0, 0), (255, 255, 255), (150, 150, 150)
MICRO_BATCH_SHADES = 6  # lightness cycles every 6 micro-batches so neighbours stay distinguishable
KIND_NAMES = {Forward: "forward", Backward: "backward", BackwardInput: "backward, input part",
              BackwardWeight: "backward, weight part"}
DURATION_NAMES = {Forward: "forward", Backward: "backward", BackwardInput: "backward-input",
                  BackwardWeight: "backward-weight"}
MARGIN, ROW_HEIGHT, ROW_GAP, STRIP = 14, 28, 6, 4  # pixels
NUMBER_FONTS = (9, 7)  # points: the micro-batch number in a box, the larger one that fits
POINT = DPI / 72  # pixels a point
TICK_LENGTH, TICK_PAD, LABEL_PAD, Y_PAD = 4, 4, 4, 6  # points


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
    name = SCHEDULE_SPECS[schedule.name].title if schedule.name in SCHEDULE_SPECS else schedule.name
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


def legend_items(timeline: Timeline) -> list[tuple[str, tuple[Colour | None, Colour | None]]]:
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


@dataclass(frozen=True)
class TimelineLayout:
    """Where everything goes in the picture, in pixels from the top-left corner, so that tests (and
    readers) can find an action's pixels."""

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
    legend_columns: int = 1
    tick_step: float = 1.0
    title_top: int = MARGIN
    plot_width: int = 0  # pixels of time: makespan x pixels_per_unit, rounded

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
    widest = text_size(_number(makespan))[0] + 3 * text_size("0")[0]
    step, ladder = 1.0, cycle((2, 2.5, 2))  # 1, 2, 5, 10, 20, 50, ...
    while step * pixels_per_unit < widest:
        step *= next(ladder)
    return step


def _legend_handles(timeline: Timeline) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles = []
    for _, (box, strip) in legend_items(timeline):
        if box is None:  # a note: words only
            handles.append(Line2D([], [], linestyle="none"))
        else:  # a box's colour, or the chunk's strip colour, framed so that light grey shows on white
            handles.append(Patch(facecolor=rgb(box if strip is None else strip), edgecolor=rgb(FRAME), linewidth=0.8))
    return handles


def timeline_layout(timeline: Timeline, *, pixels_per_unit: float | None = None) -> TimelineLayout:
    """Size the picture: about 1200 pixels of time unless ``pixels_per_unit`` is given."""
    makespan = float(timeline.makespan) or 1.0
    scale = pixels_per_unit or max(4.0, min(48.0, 1200 / makespan))
    plot_width = max(1, round(makespan * scale))
    schedule = timeline.schedule
    ranks = schedule.pipeline_ranks
    label_width = max(text_size(row_label(schedule, r))[0] for r in range(ranks))
    left = MARGIN + ceil(label_width + Y_PAD * POINT) + 4
    title_height = text_size(timeline_title(timeline), TITLE_FONT)[1]
    top = MARGIN + ceil(title_height) + 10 + ROW_GAP  # row 0, under the title and one row gap
    axis_top = top + ranks * (ROW_HEIGHT + ROW_GAP)  # the axes end one row gap under the last row
    tick_step = _tick_step(makespan, scale)
    line = text_size("0123456789")[1]
    legend_top = axis_top + ceil((TICK_LENGTH + TICK_PAD + LABEL_PAD) * POINT + 2 * line) + 16
    last_tick = _number(int(makespan / tick_step + 1e-9) * tick_step)
    room = max(left + plot_width + ceil(text_size(last_tick)[0] / 2),
               MARGIN + ceil(text_size(timeline_title(timeline), TITLE_FONT)[0]),
               left + ceil(text_size(axis_title(timeline))[0])) + MARGIN
    labels = [words for words, _ in legend_items(timeline)]
    columns, *size = fit_legend(lambda: _legend_handles(timeline), labels, room - 2 * MARGIN)
    width = max(room, MARGIN + size[0] + MARGIN)
    height = legend_top + size[1] + MARGIN
    return TimelineLayout(scale, left, top, ROW_HEIGHT, ROW_GAP, ranks, width, height, axis_top, legend_top,
                          columns, tick_step, MARGIN, plot_width)


def render_timeline(timeline: Timeline, *, pixels_per_unit: float | None = None):
    """Draw ``timeline`` (see the module docstring) on a new matplotlib Figure."""
    from matplotlib.collections import PolyCollection
    from matplotlib.ticker import FuncFormatter, MultipleLocator
    layout = timeline_layout(timeline, pixels_per_unit=pixels_per_unit)
    schedule = timeline.schedule
    width, height = layout.width, layout.height
    figure = new_figure(width, height, "the timeline picture")
    figure.text(MARGIN / width, 1 - layout.title_top / height, plain(timeline_title(timeline)), fontsize=TITLE_FONT,
                ha="left", va="top", color=rgb(INK))
    # The axes cover rows and gaps to the pixel: data x is time, data y is pixels down from the axes' top.
    axes_top = layout.top - layout.row_gap
    axes_height = layout.axis_top - axes_top
    axes = figure.add_axes((layout.left / width, 1 - layout.axis_top / height, layout.plot_width / width,
                            axes_height / height), facecolor=rgb(BACKGROUND))
    axes.set_xlim(0, layout.plot_width / layout.pixels_per_unit)
    axes.set_ylim(axes_height, 0)

    def data(x, y):  # picture pixels -> data coordinates
        return (x - layout.left) / layout.pixels_per_unit, y - axes_top

    boxes, fills = [], []  # pixel boxes (x0, y0, x1, y1), drawn in this order as one collection

    def rectangle(x0, y0, x1, y1, colour):
        boxes.append((x0, y0, x1, y1))
        fills.append(rgb(colour))

    for rank in range(layout.ranks):
        top = layout.row_top(rank)
        rectangle(layout.left, top, layout.x(timeline.makespan), top + layout.row_height, IDLE)
    for entry in timeline.entries:
        x0, y0, x1, y1 = layout.box(entry)
        fill = action_colour(entry.action)
        rectangle(x0, y0, x1, y1, fill)
        strip = 0
        if schedule.virtual_stages > 1:
            chunk = entry.action.stage // schedule.pipeline_ranks
            rectangle(x0, y0, x1, y0 + STRIP, CHUNK_COLOURS[chunk % len(CHUNK_COLOURS)])
            strip = STRIP
        label = str(entry.action.micro_batch)
        for size in NUMBER_FONTS:  # the largest number that leaves 2 pixels either side
            if text_size(label, size)[0] <= x1 - x0 - 4:
                axes.text(*data((x0 + x1) / 2, (y0 + strip + y1) / 2), label, fontsize=size, ha="center",
                          va="center_baseline", color=rgb(_ink_on(fill)))
                break
    # without anti-aliasing, so that each box is exactly its colour, to the pixel
    axes.add_collection(PolyCollection([[data(x0, y0), data(x1, y0), data(x1, y1), data(x0, y1)]
                                        for x0, y0, x1, y1 in boxes], facecolors=fills, linewidths=0,
                                       antialiaseds=False), autolim=False)
    axes.set_yticks([layout.row_top(r) + layout.row_height / 2 - axes_top for r in range(layout.ranks)],
                    [plain(row_label(schedule, r)) for r in range(layout.ranks)])
    axes.tick_params(axis="y", length=0, pad=Y_PAD, labelsize=FONT)
    axes.tick_params(axis="x", length=TICK_LENGTH, pad=TICK_PAD, labelsize=FONT)
    axes.xaxis.set_major_locator(MultipleLocator(layout.tick_step))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _number(round(value, 9))))
    axes.set_xlabel(plain(axis_title(timeline)), fontsize=FONT, loc="left", labelpad=LABEL_PAD)
    for side in ("left", "top", "right"):
        axes.spines[side].set_visible(False)
    add_legend(figure, _legend_handles(timeline), [words for words, _ in legend_items(timeline)],
               layout.legend_columns, MARGIN, layout.legend_top)
    return figure


def render_timeline_png(timeline: Timeline, *, pixels_per_unit: float | None = None) -> bytes:
    """The timeline picture as PNG bytes, ``timeline_layout(...).width`` x ``.height`` pixels."""
    return png_bytes(render_timeline(timeline, pixels_per_unit=pixels_per_unit))


def write_timeline_png(timeline: Timeline, path, *, pixels_per_unit: float | None = None) -> Path:
    """Write the timeline picture to ``path`` and return it as a Path."""
    return write_png(render_timeline(timeline, pixels_per_unit=pixels_per_unit), path, option="--timeline")
