"""Print a schedule as text, one line per rank, and draw a simulated timeline as a PNG picture.

Text tokens: ``F3`` forward of micro-batch 3, ``B3`` its backward, ``BI3``/``BW3`` the input and
weight parts of a split backward. On a rank holding several stages (interleaved) the stage is added:
``F3@s5``. With ``communication=True`` transfers appear too: ``Sa3>r1`` sends micro-batch 3's
activation to rank 1, ``Rg3<r2`` receives its gradient from rank 2.

Picture: one row per rank, time to the right; grey is idle (the bubble). Each compute action is a
rectangle coloured by kind (forward blue, backward green, split input/weight backward amber/red),
lighter for later micro-batches, and labelled with its micro-batch number in a built-in 3x5 pixel
font (``png_canvas``); when the rectangle is too narrow the label is left out. On ranks holding
several stages a strip along the top gives the chunk (dark: first chunk, then magenta, orange,
teal...). The bottom legend draws each kind and chunk strip as a coloured box with its letter.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .png_canvas import Canvas, Colour, text_size
from .schedule_sim import TimedAction, Timeline
from .schedules import (ACTIVATION, Action, Backward, BackwardInput, BackwardWeight, Forward, Recv, Schedule, Send)

KIND_COLOURS: dict[type, Colour] = {Forward: (66, 133, 244), Backward: (52, 168, 83),
                                    BackwardInput: (244, 180, 0), BackwardWeight: (219, 68, 55)}
KIND_LETTERS = {Forward: "F", Backward: "B", BackwardInput: "BI", BackwardWeight: "BW"}
CHUNK_COLOURS: tuple[Colour, ...] = ((40, 40, 40), (200, 0, 200), (255, 120, 0), (0, 150, 150))
IDLE, BACKGROUND, INK = (225, 225, 225), (255, 255, 255), (0, 0, 0)
MICRO_BATCH_SHADES = 6  # lightness cycles every 6 micro-batches so neighbours stay distinguishable


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


@dataclass(frozen=True)
class TimelineLayout:
    """Where everything goes in the picture, so tests (and readers) can find an action's pixels."""

    pixels_per_unit: float
    left: int  # x of time 0
    top: int
    row_height: int
    row_gap: int
    ranks: int
    width: int
    height: int

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

    @property
    def legend_top(self) -> int:
        return self.row_top(self.ranks) + 6


def _legend_items(timeline: Timeline) -> list[tuple[str, Colour]]:
    kinds = [kind for kind in KIND_COLOURS if any(type(e.action) is kind for e in timeline.entries)]
    items = [(KIND_LETTERS[kind], KIND_COLOURS[kind]) for kind in kinds]
    if timeline.schedule.virtual_stages > 1:
        items += [(f"c{chunk}", CHUNK_COLOURS[chunk % len(CHUNK_COLOURS)])
                  for chunk in range(timeline.schedule.virtual_stages)]
    return items


def _legend_item_width(letters: str) -> int:
    return 18 + text_size(letters, 2)[0] + 14  # box, gap, label, gap


def timeline_layout(timeline: Timeline, *, pixels_per_unit: float | None = None) -> TimelineLayout:
    """Size the picture: about 1200 pixels of time unless ``pixels_per_unit`` is given."""
    makespan = float(timeline.makespan) or 1.0
    scale = pixels_per_unit or max(4.0, min(48.0, 1200 / makespan))
    ranks = timeline.schedule.pipeline_ranks
    left = 10 + text_size(f"r{ranks - 1}", 2)[0] + 8
    layout = TimelineLayout(scale, left, 10, 24, 6, ranks, 0, 0)
    legend = sum(_legend_item_width(letters) for letters, _ in _legend_items(timeline))
    width = max(layout.x(makespan), left + legend) + 12
    return TimelineLayout(scale, left, 10, 24, 6, ranks, width, layout.legend_top + 14 + 10)


def render_timeline(timeline: Timeline, *, pixels_per_unit: float | None = None) -> Canvas:
    """Draw ``timeline`` (see the module docstring) on a new Canvas."""
    layout = timeline_layout(timeline, pixels_per_unit=pixels_per_unit)
    schedule = timeline.schedule
    canvas = Canvas(layout.width, layout.height, BACKGROUND)
    for rank in range(layout.ranks):
        top = layout.row_top(rank)
        canvas.fill_rect(layout.left, top, layout.x(timeline.makespan), top + layout.row_height, IDLE)
        canvas.draw_text(10, top + (layout.row_height - 10) // 2, f"r{rank}", INK, scale=2)
    for entry in timeline.entries:
        x0, y0, x1, y1 = layout.box(entry)
        canvas.fill_rect(x0, y0, x1, y1, action_colour(entry.action))
        if schedule.virtual_stages > 1:
            chunk = entry.action.stage // schedule.pipeline_ranks
            canvas.fill_rect(x0, y0, x1, y0 + 4, CHUNK_COLOURS[chunk % len(CHUNK_COLOURS)])
        label = str(entry.action.micro_batch)
        for scale in (2, 1):  # the largest label that leaves 2 pixels either side
            width, height = text_size(label, scale)
            if width <= x1 - x0 - 4:
                canvas.draw_text(x0 + (x1 - x0 - width) // 2, y0 + (layout.row_height - height) // 2 + 1,
                                 label, INK, scale)
                break
    _draw_legend(canvas, layout, timeline)
    return canvas


def _draw_legend(canvas: Canvas, layout: TimelineLayout, timeline: Timeline) -> None:
    x, y = layout.left, layout.legend_top
    for letters, colour in _legend_items(timeline):
        canvas.fill_rect(x, y, x + 14, y + 14, colour)
        canvas.draw_text(x + 18, y + 2, letters, INK, scale=2)
        x += _legend_item_width(letters)


def render_timeline_png(timeline: Timeline, *, pixels_per_unit: float | None = None) -> bytes:
    return render_timeline(timeline, pixels_per_unit=pixels_per_unit).to_png()


def write_timeline_png(timeline: Timeline, path, *, pixels_per_unit: float | None = None) -> Path:
    """Write the timeline picture to ``path`` and return it as a Path."""
    path = Path(path)
    path.write_bytes(render_timeline_png(timeline, pixels_per_unit=pixels_per_unit))
    return path
