"""Draw a plan's predicted memory as a PNG: one bar per pipeline rank, and the usable limit as a line.

Bar ``i`` is ``plan.predicted.memory_bytes_per_device[i]`` (the busiest device of pipeline rank i's
stages); the red line is the smallest ``memory_limit_bytes`` of the plan's stages (what the planner
allowed). Heights share one linear scale, from the bottom of the plot, whose top is 10% above the
larger of the tallest bar and the limit, so bar heights are proportional to the bytes (rounded to
pixels; a non-zero bar keeps at least one) and a bar crossing the line does not fit. A bar over
the limit is drawn red-orange instead of blue. The rank number is written under each bar with
the 3x5 font of ``png_canvas`` (digits only, hence no text legend: the colours and the line are
described here and by ``xirang explain``).
"""
from __future__ import annotations

from pathlib import Path

from .png_canvas import Canvas, text_size

BAR, OVER, LIMIT, AXIS, INK = (66, 133, 244), (234, 110, 40), (219, 0, 0), (120, 120, 120), (0, 0, 0)
PLOT_HEIGHT, MARGIN, BAR_WIDTH, GAP, SCALE = 200, 20, 40, 20, 2
HEADROOM = 1.1  # the top of the scale, relative to the larger of the tallest bar and the limit


def layout(plan) -> dict:
    """Pixel geometry of the picture: bar boxes (x0, y0, x1, y1) and the limit line's row, so tests and
    callers can read the picture without decoding guesses."""
    memory = list(plan.predicted.memory_bytes_per_device)
    limit = min(stage.memory_limit_bytes for stage in plan.stages)
    top = max(max(memory, default=0), limit, 1) * HEADROOM
    base = MARGIN + PLOT_HEIGHT  # y of the plot's bottom edge (exclusive)
    bars = []
    for rank, nbytes in enumerate(memory):
        x0 = 2 * MARGIN + rank * (BAR_WIDTH + GAP)
        # a non-zero figure keeps one pixel, so a small model's bars still show against a big device
        height = max(round(nbytes / top * PLOT_HEIGHT), 1 if nbytes else 0)
        bars.append((x0, base - height, x0 + BAR_WIDTH, base))
    width = 2 * MARGIN + len(memory) * (BAR_WIDTH + GAP) - GAP + 2 * MARGIN
    return {"bars": bars, "limit_y": base - round(limit / top * PLOT_HEIGHT), "base": base, "width": width,
            "height": base + MARGIN + text_size("0", SCALE)[1] + MARGIN // 2, "memory": memory, "limit": limit}


def draw_memory(plan) -> Canvas:
    geometry = layout(plan)
    canvas = Canvas(geometry["width"], geometry["height"])
    base = geometry["base"]
    canvas.fill_rect(MARGIN, MARGIN, MARGIN + 1, base + 1, AXIS)  # y axis
    canvas.fill_rect(MARGIN, base, geometry["width"] - MARGIN, base + 1, AXIS)  # x axis
    for rank, ((x0, y0, x1, y1), nbytes) in enumerate(zip(geometry["bars"], geometry["memory"])):
        canvas.fill_rect(x0, y0, x1, y1, OVER if nbytes > geometry["limit"] else BAR)
        label = str(rank)
        label_width, _ = text_size(label, SCALE)
        canvas.draw_text(x0 + (BAR_WIDTH - label_width) // 2, base + MARGIN // 2, label, INK, SCALE)
    y = geometry["limit_y"]  # drawn last: the line stays visible across the bars
    canvas.fill_rect(MARGIN + 1, y - 1, geometry["width"] - MARGIN, y + 1, LIMIT)
    return canvas


def write_memory_png(plan, path) -> Path:
    """Write the memory picture of ``plan`` to ``path`` (PNG); returns the resolved path."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        from xirang.errors import XirangError
        raise XirangError(f"cannot write {path}: folder {path.parent} does not exist", where="--picture",
                          hint="create the folder first or give another path")
    path.write_bytes(draw_memory(plan).to_png())
    return path.resolve()
