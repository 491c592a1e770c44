"""What the pictures share: matplotlib, imported only when a picture is drawn (it is the optional
``viz`` extra), a figure of an exact size in pixels, text measured in pixels, and PNG output.

Figures are ``matplotlib.figure.Figure`` objects with the Agg canvas attached; nothing touches
pyplot's global state, so drawing is safe inside a library, a test run or a rank process.
"""
from __future__ import annotations

from functools import lru_cache
from math import ceil
from io import BytesIO
from pathlib import Path

from xirang.ir.errors import XirangError

DPI = 100  # a point is 100/72 pixels; figure sizes are given in pixels
FONT = 10  # points: labels, ticks, legend
TITLE_FONT = 12
Colour = tuple  # (r, g, b), each 0-255


def require_matplotlib(what: str = "the picture"):
    """The matplotlib module, or a XirangError saying how to install it."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401  (the Agg backend is present)
    except ImportError as error:
        raise XirangError(f"drawing {what} needs matplotlib, which is not installed", where="xirang.codegen.viz",
                          hint='pip install "xirang[viz]" (or pip install "matplotlib>=3.7")') from error
    return matplotlib


def new_figure(width: int, height: int, what: str = "the picture"):
    """A white Figure of ``width`` x ``height`` pixels on an Agg canvas (no pyplot)."""
    require_matplotlib(what)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, facecolor="white")
    FigureCanvasAgg(figure)
    return figure


@lru_cache(maxsize=None)
def _renderer():
    from matplotlib.backends.backend_agg import RendererAgg
    return RendererAgg(8, 8, DPI)


@lru_cache(maxsize=4096)
def text_size(text: str, size: float = FONT) -> tuple[float, float]:
    """(width, height) in pixels of ``text`` in matplotlib's default font at ``size`` points."""
    require_matplotlib()
    from matplotlib.font_manager import FontProperties
    width, height, _ = _renderer().get_text_width_height_descent(plain(text), FontProperties(size=size),
                                                                  ismath=False)
    return width, height


def rgb(colour: Colour) -> tuple[float, float, float]:
    """matplotlib's 0-1 floats for a 0-255 colour; Agg rounds them back to the same bytes."""
    return tuple(c / 255 for c in colour)


def plain(text: str) -> str:
    """``text`` with dollar signs escaped, so that matplotlib does not read it as mathtext."""
    return text.replace("$", r"\$")


def png_bytes(figure) -> bytes:
    """The figure as PNG bytes, exactly its size in pixels (no tight cropping)."""
    buffer = BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, facecolor=figure.get_facecolor())
    return buffer.getvalue()


def add_legend(figure, handles: list, labels: list[str], columns: int, x: float, y: float):
    """A frameless legend with its top-left corner at pixel (x, y) of ``figure`` (y from the top),
    read row by row (matplotlib fills columns first, so the entries are reordered for it)."""
    order = [i for j in range(columns) for i in range(j, len(labels), columns)]
    width, height = figure.get_figwidth() * DPI, figure.get_figheight() * DPI
    return figure.legend([handles[i] for i in order], [plain(labels[i]) for i in order], loc="upper left",
                         ncols=columns, frameon=False, fontsize=FONT, borderaxespad=0, borderpad=0,
                         handlelength=1.6, columnspacing=1.6, bbox_to_anchor=(x / width, 1 - y / height))


def fit_legend(handles_of, labels: list[str], room: float) -> tuple[int, int, int]:
    """(columns, width, height): the most columns (at most one row) whose legend is at most ``room``
    pixels wide, and that legend's size, measured by drawing it. ``handles_of()`` makes new handles
    (an artist belongs to one figure)."""
    columns = len(labels)
    while True:
        figure = new_figure(100, 100)  # the legend's size does not depend on the figure's
        legend = add_legend(figure, handles_of(), labels, columns, 0, 0)
        box = legend.get_window_extent(figure.canvas.get_renderer())
        if box.width <= room or columns == 1:
            return columns, ceil(box.width), ceil(box.height)
        columns -= 1


def write_png(figure, path, *, option: str) -> Path:
    """Write ``figure`` to ``path``; a missing folder is a XirangError naming the ``option``."""
    path = Path(path)
    if not path.parent.exists():
        raise XirangError(f"cannot write {path}: folder {path.parent} does not exist", where=option,
                          hint="create the folder first or give another path")
    path.write_bytes(png_bytes(figure))
    return path
