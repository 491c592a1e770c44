"""Draw a plan's predicted memory as a PNG: one bar per pipeline rank, and the usable limit as a line.

Bar ``i`` is ``plan.predicted.memory_bytes_per_device[i]`` (the busiest device of pipeline rank i's
stages); the red line is the smallest ``memory_limit_bytes`` of the plan's stages (what the planner
allowed). Heights share one linear scale, from the bottom of the plot, whose top is the first
y-axis tick at or above 110% of the larger of the tallest bar and the limit, so bar heights are
proportional to the bytes (rounded to pixels; a non-zero bar keeps at least one) and a bar crossing
the line does not fit. A bar over the limit is drawn red-orange instead of blue.

Text (5x7 font of ``font_5x7`` at scale 2): a title and a line naming the plan (mesh, devices,
schedule, recompute), the y axis in GiB with tick labels and light grid lines, each bar's value
above it (inside its top when the limit line would cross the text), "rank r" and its stages under
each bar, "usable 72.0 GiB" at the right end of the line, and a legend of the colours. The bars are
not stacked by kind: a Plan records one figure per pipeline rank.
"""
from __future__ import annotations

from math import ceil, floor, log10
from pathlib import Path

from xirang.codegen.viz.font_5x7 import GLYPH_HEIGHT, printable
from xirang.codegen.viz.png_canvas import Canvas, text_size

BAR, OVER, LIMIT, AXIS, INK = (66, 133, 244), (234, 110, 40), (219, 0, 0), (120, 120, 120), (0, 0, 0)
GRID, WHITE = (232, 232, 232), (255, 255, 255)
PLOT_HEIGHT, MARGIN, GAP, SCALE, SWATCH = 300, 16, 20, 2, 16
LINE, CAP = text_size("A", SCALE)[1], GLYPH_HEIGHT * SCALE  # a line of text (18), a digit (14)
HEADROOM = 1.1  # at least this much room above the larger of the tallest bar and the limit
GiB = 1024**3
TITLE = "Predicted memory per device, by pipeline rank"


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
    return printable(f"{plan.mesh} on {plan.world.size} {devices}, {plan.schedule} m={plan.num_micro_batches}"
                     f"{chunks}, recompute {plan.recompute}, {plan.precision}")


def bar_labels(plan, rank: int) -> tuple[str, str]:
    stages = [stage.index for stage in plan.stages_of(rank)]
    shown = stages if len(stages) <= 3 else [stages[0], stages[1], "..", stages[-1]]
    return f"rank {rank}", f"stage{'s' * (len(stages) > 1)} {','.join(map(str, shown))}"


def _legend(geometry: dict) -> list[tuple[str, tuple]]:
    """(words, colour, swatch kind) of each legend entry; 'line' draws a bar of the line's height."""
    limit = geometry["limit"]
    items = [("fits in usable memory", BAR, "box")] if any(m <= limit for m in geometry["memory"]) else []
    if any(m > limit for m in geometry["memory"]):
        items.append(("over usable memory", OVER, "box"))
    return items + [("usable memory: smallest limit of the stages", LIMIT, "line")]


def _value_top(bar: tuple[int, int, int, int], limit_y: int) -> tuple[int, bool]:
    """(y, inside) for a bar's value: above the bar unless the limit line crosses the text there,
    then inside the bar's top; the two places are far enough apart that one is always clear."""
    _, y0, _, y1 = bar

    def clear(y):
        return not (y - 4 <= limit_y <= y + CAP + 4)

    above = y0 - 5 - CAP
    if clear(above) or y1 - y0 < CAP + 8:
        return (above if clear(above) else limit_y - 6 - CAP), False
    return y0 + 5, True


def layout(plan) -> dict:
    """Pixel geometry of the picture: bar boxes (x0, y0, x1, y1), the limit line's row, where each
    label goes, so tests and callers can read the picture without decoding guesses."""
    memory = list(plan.predicted.memory_bytes_per_device)
    limit = min(stage.memory_limit_bytes for stage in plan.stages)
    room_gib = max(max(memory, default=0), limit, 1) * HEADROOM / GiB
    step = _tick_step(room_gib)
    intervals = ceil(room_gib / step - 1e-9)
    top = intervals * step * GiB  # the scale ends on a labelled tick
    ticks = [k * step for k in range(intervals + 1)]
    tick_labels = [f"{t:g}" for t in ticks]
    axis_x = MARGIN + max(text_size(t, SCALE)[0] for t in tick_labels) + 10
    plot_top = MARGIN + 2 * LINE + 6 + 16 + LINE + 14  # title, subtitle, y-axis title
    base = plot_top + PLOT_HEIGHT  # y of the plot's bottom edge (exclusive)
    labels = [bar_labels(plan, rank) for rank in range(len(memory))]
    bar_width = max(text_size(text, SCALE)[0] for text in
                    [_amount(m) for m in memory] + [line for pair in labels for line in pair]) + 10
    bars = []
    for rank, nbytes in enumerate(memory):
        x0 = axis_x + GAP + rank * (bar_width + GAP)
        # a non-zero figure keeps one pixel, so a small model's bars still show against a big device
        height = max(round(nbytes / top * PLOT_HEIGHT), 1 if nbytes else 0)
        bars.append((x0, base - height, x0 + bar_width, base))
    plot_right = axis_x + GAP + len(memory) * (bar_width + GAP)
    limit_y = base - round(limit / top * PLOT_HEIGHT)
    limit_label = f"usable {_amount(limit)}"
    geometry = {"bars": bars, "limit_y": limit_y, "base": base, "memory": memory, "limit": limit,
                "axis_x": axis_x, "plot_top": plot_top, "plot_right": plot_right, "bar_labels": labels,
                "ticks": [(base - round(t * GiB / top * PLOT_HEIGHT), label) for t, label in zip(ticks, tick_labels)],
                "values": [(_amount(m), *_value_top(bar, limit_y)) for m, bar in zip(memory, bars)],
                "limit_label": (limit_label, plot_right + 8, limit_y - CAP // 2),
                "title": (TITLE, MARGIN, MARGIN), "subtitle": (subtitle(plan), MARGIN, MARGIN + LINE + 6)}
    legend_top = base + 10 + 2 * LINE + 16
    x, y, rows = MARGIN, legend_top, []
    right = max(plot_right + 8 + text_size(limit_label, SCALE)[0],
                MARGIN + max(text_size(t, SCALE)[0] for t in (TITLE, geometry["subtitle"][0])))
    for words, _, _ in _legend(geometry):
        width = SWATCH + 8 + text_size(words, SCALE)[0] + 24
        if x > MARGIN and x + width - 24 > right:
            x, y = MARGIN, y + LINE + 8
        rows.append((x, y))
        x += width
        right = max(right, x - 24)
    geometry.update(legend=rows, width=right + MARGIN, height=y + LINE + MARGIN)
    return geometry


def draw_memory(plan) -> Canvas:
    geometry = layout(plan)
    canvas = Canvas(geometry["width"], geometry["height"])
    for text, x, y in (geometry["title"], geometry["subtitle"]):
        canvas.draw_text(x, y, text, INK, SCALE)
    axis_x, base, right = geometry["axis_x"], geometry["base"], geometry["plot_right"]
    canvas.draw_text(MARGIN, geometry["plot_top"] - LINE - 10, "GiB per device", INK, SCALE)  # the y axis' unit
    for y, label in geometry["ticks"]:
        canvas.fill_rect(axis_x + 1, y, right, y + 1, GRID)
        canvas.fill_rect(axis_x - 5, y, axis_x, y + 1, AXIS)
        canvas.draw_text(axis_x - 8 - text_size(label, SCALE)[0], y - CAP // 2, label, INK, SCALE)
    canvas.fill_rect(axis_x, geometry["plot_top"] - 6, axis_x + 1, base + 1, AXIS)  # y axis
    canvas.fill_rect(axis_x, base, right, base + 1, AXIS)  # x axis
    y = geometry["limit_y"]  # under the bars' text, over the bars: the line stays visible across them
    for (x0, y0, x1, y1), nbytes in zip(geometry["bars"], geometry["memory"]):
        canvas.fill_rect(x0, y0, x1, y1, OVER if nbytes > geometry["limit"] else BAR)
    canvas.fill_rect(axis_x + 1, y - 1, right, y + 1, LIMIT)
    label, x, label_y = geometry["limit_label"]
    canvas.draw_text(x, label_y, label, LIMIT, SCALE)
    for (x0, _, x1, _), (value, value_y, inside), pair in zip(geometry["bars"], geometry["values"],
                                                              geometry["bar_labels"]):
        width = text_size(value, SCALE)[0]
        canvas.draw_text(x0 + (x1 - x0 - width) // 2, value_y, value, WHITE if inside else INK, SCALE)
        for line, text in enumerate(pair):
            width = text_size(text, SCALE)[0]
            canvas.draw_text(x0 + (x1 - x0 - width) // 2, base + 10 + line * LINE, text, INK, SCALE)
    for (words, colour, kind), (x, y) in zip(_legend(geometry), geometry["legend"]):
        if kind == "line":
            canvas.fill_rect(x, y + SWATCH // 2 - 1, x + SWATCH, y + SWATCH // 2 + 1, colour)
        else:
            canvas.fill_rect(x, y, x + SWATCH, y + SWATCH, colour)
        canvas.draw_text(x + SWATCH + 8, y + 1, words, INK, SCALE)
    return canvas


def write_memory_png(plan, path) -> Path:
    """Write the memory picture of ``plan`` to ``path`` (PNG); returns the resolved path."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        from xirang.ir.errors import XirangError
        raise XirangError(f"cannot write {path}: folder {path.parent} does not exist", where="--picture",
                          hint="create the folder first or give another path")
    path.write_bytes(draw_memory(plan).to_png())
    return path.resolve()
