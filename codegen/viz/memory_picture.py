"""Draw a plan's predicted memory as a PNG: one bar per pipeline rank, and the usable limit as a line.

Bar ``i`` is ``plan.predicted.memory_bytes_per_device[i]`` (the busiest device of pipeline rank i's
stages); the red line is the smallest ``memory_limit_bytes`` of the plan's stages (what the planner
allowed). The y axis is in GiB from 0 to the first tick at or above 110% of the larger of the
tallest bar and the limit, so bar heights are proportional to the bytes (a non-zero figure keeps a
pixel above the axis, so a small model's bars still show against a big device) and a bar crossing
the line does not fit. A bar over the limit is drawn red-orange instead of blue.

With ``measured`` (bytes per pipeline rank, from a run: ``xirang run --memory-picture``), a
purple marker crosses each bar at the measured figure, and the title says so: predicted bar,
measured marker. What was measured is said in the legend (``measured_what``): on CUDA ranks the
allocator's peak, on CPU ranks the plan's states plus the saved activations the probe measured.

Drawn with matplotlib (the ``viz`` extra; see ``plotting``): a title and a line naming the plan
(mesh, devices, schedule, recompute), the y axis in GiB with light grid lines, each bar's value
above it (inside its top, in white, when the limit line would cross the text), "rank r" and its
stages under each bar, "usable 72.0 GiB" at the right end of the line, and a legend of the colours.
The bars are not stacked by kind: a Plan records one figure per pipeline rank. The plot area is
placed to the pixel (``memory_layout``), so tests can measure bars in the PNG.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil, floor, log10
from pathlib import Path

from xirang.codegen.viz.plotting import (DPI, FONT, TITLE_FONT, add_legend, fit_legend, new_figure, plain, png_bytes,
                                         rgb, text_size, write_png)
from xirang.ir.errors import InvalidValue

BAR, OVER, LIMIT, AXIS, INK = (66, 133, 244), (234, 110, 40), (219, 0, 0), (120, 120, 120), (0, 0, 0)
MEASURED = (128, 0, 160)  # the measured marker
MARKER = 3  # pixels: its thickness; it reaches this far past each side of the bar
GRID, WHITE = (232, 232, 232), (255, 255, 255)
PLOT_HEIGHT, MARGIN, GAP = 300, 14, 24  # pixels: the plot's height, the picture's margin, between bars
HEADROOM = 1.1  # at least this much room above the larger of the tallest bar and the limit
POINT = DPI / 72  # pixels a point
TICK_LENGTH, TICK_PAD, LABEL_PAD, VALUE_OFFSET = 4, 4, 6, 4  # points
GiB = 1024**3
TITLE = "Predicted memory per device, by pipeline rank"
TITLE_MEASURED = "Predicted (bars) and measured (markers) memory per device, by pipeline rank"


def _amount(nbytes: float) -> str:
    """'71.4 GiB', or MiB/KiB/B below a tenth of the larger unit."""
    for unit, name in ((GiB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if nbytes >= unit / 10:
            return f"{nbytes / unit:.1f} {name}"
    return f"{nbytes:.0f} B"


def _tick_step(top_gib: float) -> float:
    """The smallest 1-2-5 step (GiB) that cuts the axis into at most 6 intervals."""
    magnitude = 10 ** floor(log10(top_gib / 6))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude * 6 >= top_gib)


def subtitle(plan) -> str:
    nodes = plan.world.nodes
    devices = nodes[0].device.name if all(n.device == nodes[0].device for n in nodes) else "devices"
    chunks = f", v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (f"{plan.mesh} on {plan.world.size} {devices}, {plan.schedule} m={plan.num_micro_batches}"
            f"{chunks}, recompute {plan.recompute}, {plan.precision}")


def bar_labels(plan, rank: int) -> tuple[str, str]:
    stages = [stage.index for stage in plan.stages_of(rank)]
    shown = stages if len(stages) <= 3 else [stages[0], stages[1], "..", stages[-1]]
    return f"rank {rank}", f"stage{'s' * (len(stages) > 1)} {','.join(map(str, shown))}"


def legend_items(memory, limit, measured_what: str = "") -> list[tuple[str, tuple, str]]:
    """(words, colour, swatch kind) of each legend entry: 'box' or 'line'."""
    items = [("fits in usable memory", BAR, "box")] if any(m <= limit for m in memory) else []
    if any(m > limit for m in memory):
        items.append(("over usable memory", OVER, "box"))
    items.append(("usable memory: smallest limit of the stages", LIMIT, "line"))
    return items + ([(f"measured: {measured_what}", MEASURED, "line")] if measured_what else [])


def _legend_handles(items) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    return [Line2D([], [], color=rgb(colour), linewidth=2) if kind == "line" else Patch(facecolor=rgb(colour))
            for _, colour, kind in items]


@dataclass(frozen=True)
class MemoryLayout:
    """Where the picture's parts go, in pixels from the top-left corner (y downwards)."""

    width: int
    height: int
    left: int  # x of the y axis
    plot_top: int  # y of the top of the plot (the last tick)
    base: int  # y of the x axis (0 GiB)
    slot: int  # pixels a bar and the gap after it take
    bar_width: int
    top_bytes: float  # bytes at the top of the plot
    ticks: tuple[float, ...]  # GiB
    memory: tuple[int, ...]
    limit: int
    values: tuple[tuple[str, bool], ...]  # each bar's value and whether it is written inside the bar
    legend_top: int
    legend_columns: int
    measured: tuple = ()  # bytes per pipeline rank (None: not measured), or () when nothing was
    measured_what: str = ""

    def y(self, nbytes: float) -> float:
        """The pixel row (from the top) of ``nbytes`` on the y axis."""
        return self.base - nbytes / self.top_bytes * PLOT_HEIGHT

    def bar(self, rank: int) -> tuple[int, int]:
        """(x0, x1) of rank's bar, half-open, in pixels."""
        x0 = self.left + GAP + rank * self.slot
        return x0, x0 + self.bar_width

    @property
    def plot_right(self) -> int:
        return self.left + GAP + len(self.memory) * self.slot


def _inside(bar_top: float, bar_height: float, limit_y: float) -> bool:
    """Whether a bar's value goes inside its top: when the limit line would cross the text above the
    bar, and the bar is tall enough to hold it (otherwise it stays above and the line crosses)."""
    text = text_size("0.0 GiB")[1]
    above = (bar_top - VALUE_OFFSET * POINT - text - 4, bar_top - VALUE_OFFSET * POINT + 4)
    return above[0] <= limit_y <= above[1] and bar_height >= text + 2 * VALUE_OFFSET * POINT + 4


def memory_layout(plan, measured=None, measured_what: str = "") -> MemoryLayout:
    memory = tuple(plan.predicted.memory_bytes_per_device)
    measured = tuple(measured or ())
    if measured and len(measured) != len(memory):
        raise InvalidValue(f"measured has {len(measured)} figures, the plan {len(memory)} pipeline ranks")
    measured_what = measured_what or ("as measured" if measured else "")
    limit = min(stage.memory_limit_bytes for stage in plan.stages)
    room_gib = max(max(memory, default=0), max((m or 0 for m in measured), default=0), limit, 1) * HEADROOM / GiB
    step = _tick_step(room_gib)
    intervals = ceil(room_gib / step - 1e-9)
    ticks = tuple(k * step for k in range(intervals + 1))
    top_bytes = intervals * step * GiB  # the scale ends on a labelled tick
    line = text_size("rank 0")[1]
    tick_width = max(text_size(f"{t:g}")[0] for t in ticks)
    left = MARGIN + ceil(line + (LABEL_PAD + TICK_PAD + TICK_LENGTH) * POINT + tick_width) + 4
    title = TITLE_MEASURED if measured else TITLE
    title_height = text_size(title, TITLE_FONT)[1]
    plot_top = MARGIN + ceil(title_height + 6 + line) + 20
    base = plot_top + PLOT_HEIGHT
    labels = [bar_labels(plan, rank) for rank in range(len(memory))]
    bar_width = ceil(max(text_size(text)[0] for text in
                         [_amount(m) for m in memory] + [words for pair in labels for words in pair])) + 12
    slot = bar_width + GAP
    plot_right = left + GAP + len(memory) * slot
    limit_label = ceil(text_size(f"usable {_amount(limit)}")[0])
    room = max(plot_right + 8 + limit_label, MARGIN + ceil(text_size(title, TITLE_FONT)[0]),
               MARGIN + ceil(text_size(subtitle(plan))[0])) + MARGIN
    legend_top = base + ceil((TICK_LENGTH + TICK_PAD) * POINT + 2 * line * 1.2) + 16
    items = legend_items(memory, limit, measured_what)
    columns, legend_width, legend_height = fit_legend(lambda: _legend_handles(items), [w for w, _, _ in items],
                                                      room - 2 * MARGIN)
    width = max(room, 2 * MARGIN + legend_width)
    partial = MemoryLayout(width, legend_top + legend_height + MARGIN, left, plot_top, base, slot, bar_width,
                           top_bytes, ticks, memory, limit, (), legend_top, columns, measured, measured_what)
    values = tuple((_amount(m), _inside(partial.y(_shown(m, top_bytes)), base - partial.y(_shown(m, top_bytes)),
                                        partial.y(limit))) for m in memory)
    return MemoryLayout(**{**partial.__dict__, "values": values})


def _shown(nbytes: float, top_bytes: float) -> float:
    """The height a bar is drawn at: its bytes, or for a tiny non-zero figure two pixels' worth (the
    x axis' line covers the lowest row of every bar, so one row shows above it)."""
    return max(nbytes, 2 * top_bytes / PLOT_HEIGHT) if nbytes else 0.0


def draw_memory(plan, measured=None, measured_what: str = ""):
    """The memory picture of ``plan`` (see the module docstring) as a matplotlib Figure; ``measured``:
    bytes per pipeline rank from a run, drawn as markers (``measured_what`` says what they are)."""
    from matplotlib.ticker import FixedLocator
    from matplotlib.transforms import blended_transform_factory
    layout = memory_layout(plan, measured, measured_what)
    title = TITLE_MEASURED if layout.measured else TITLE
    width, height = layout.width, layout.height
    figure = new_figure(width, height, "the memory picture")
    figure.text(MARGIN / width, 1 - MARGIN / height, title, fontsize=TITLE_FONT, ha="left", va="top",
                color=rgb(INK))
    figure.text(MARGIN / width, 1 - (MARGIN + text_size(title, TITLE_FONT)[1] + 6) / height, plain(subtitle(plan)),
                fontsize=FONT, ha="left", va="top", color=rgb(INK))
    # data x: pixels right of the y axis; data y: GiB
    plot_width = layout.plot_right - layout.left
    axes = figure.add_axes((layout.left / width, 1 - layout.base / height, plot_width / width, PLOT_HEIGHT / height))
    top_gib = layout.top_bytes / GiB
    axes.set_xlim(0, plot_width)
    axes.set_ylim(0, top_gib)
    axes.yaxis.set_major_locator(FixedLocator(layout.ticks))
    axes.set_yticklabels([f"{t:g}" for t in layout.ticks])
    axes.grid(axis="y", color=rgb(GRID), linewidth=1)
    axes.set_axisbelow(True)
    axes.set_ylabel("GiB per device", fontsize=FONT, labelpad=LABEL_PAD)
    axes.tick_params(length=TICK_LENGTH, pad=TICK_PAD, labelsize=FONT, color=rgb(AXIS))
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        axes.spines[side].set_color(rgb(AXIS))
    centres = []
    for rank, nbytes in enumerate(layout.memory):
        x0, x1 = layout.bar(rank)
        centres.append((x0 + x1) / 2 - layout.left)
        axes.bar(centres[-1], _shown(nbytes, layout.top_bytes) / GiB, width=x1 - x0, antialiased=False,
                 color=rgb(OVER if nbytes > layout.limit else BAR), linewidth=0)
    axes.set_xticks(centres, [plain("\n".join(bar_labels(plan, rank))) for rank in range(len(layout.memory))])
    axes.tick_params(axis="x", length=0)
    limit = layout.limit / GiB  # under the bars' text, over the bars: the line stays visible across them
    axes.axhline(limit, color=rgb(LIMIT), linewidth=1.5, zorder=3)
    axes.text(1.0, limit, f"  usable {_amount(layout.limit)}", transform=blended_transform_factory(
        axes.transAxes, axes.transData), ha="left", va="center", color=rgb(LIMIT), fontsize=FONT, clip_on=False)
    for centre, nbytes, (value, inside) in zip(centres, layout.memory, layout.values):
        axes.annotate(value, (centre, _shown(nbytes, layout.top_bytes) / GiB), textcoords="offset points",
                      xytext=(0, -VALUE_OFFSET if inside else VALUE_OFFSET), ha="center",
                      va="top" if inside else "bottom", fontsize=FONT, color=rgb(WHITE if inside else INK), zorder=4)
    for rank, nbytes in enumerate(layout.measured):
        if nbytes is None:
            continue
        x0, x1 = layout.bar(rank)
        y = nbytes / GiB
        axes.plot([x0 - layout.left - MARKER, x1 - layout.left + MARKER], [y, y], color=rgb(MEASURED),
                  linewidth=MARKER * 72 / DPI, solid_capstyle="butt", antialiased=False, zorder=5)
    items = legend_items(layout.memory, layout.limit, layout.measured_what)
    add_legend(figure, _legend_handles(items), [words for words, _, _ in items], layout.legend_columns, MARGIN,
               layout.legend_top)
    return figure


def render_memory_png(plan, measured=None, measured_what: str = "") -> bytes:
    """The memory picture as PNG bytes, ``memory_layout(plan).width`` x ``.height`` pixels."""
    return png_bytes(draw_memory(plan, measured, measured_what))


def write_memory_png(plan, path, measured=None, measured_what: str = "", option: str = "--picture") -> Path:
    """Write the memory picture of ``plan`` to ``path`` (PNG); returns the resolved path."""
    return write_png(draw_memory(plan, measured, measured_what), path, option=option).resolve()
