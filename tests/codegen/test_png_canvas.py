"""The 5x7 font and the canvas text: every glyph well formed and unlike the others, text inside its box."""
from __future__ import annotations

import string

import pytest

from xirang.codegen.viz.font_5x7 import DROP, FONT_5X7, LINE_HEIGHT, printable
from xirang.codegen.viz.png_canvas import Canvas, text_size

INK, PAPER = (0, 0, 0), (255, 255, 255)
NEEDED = string.ascii_uppercase + string.ascii_lowercase + string.digits + " .,:;-+=/()%x*_<>[]'\""


def inked(canvas: Canvas, colour=INK) -> set[tuple[int, int]]:
    return {(x, y) for y in range(canvas.height) for x in range(canvas.width) if canvas.pixel(x, y) == colour}


def test_the_font_covers_what_labels_need_with_5x7_glyphs_all_different():
    assert set(NEEDED) <= set(FONT_5X7)
    for character, rows in FONT_5X7.items():
        assert len(rows) == 7 and all(len(row) == 5 and set(row) <= {"0", "1"} for row in rows), character
    bitmaps = {}
    for character, rows in FONT_5X7.items():
        assert rows not in bitmaps, f"{character!r} looks exactly like {bitmaps.get(rows)!r}"
        bitmaps[rows] = character
    assert all("1" not in row for row in FONT_5X7[" "]) and all(
        any("1" in row for row in rows) for character, rows in FONT_5X7.items() if character != " ")
    # the look-alikes a reader must tell apart
    for a, b in ("0O", "1l", "1I", "Il", "5S", "2Z", "8B", "xX", "oO", "cC", "sS", "vV", "wW", "zZ"):
        assert FONT_5X7[a] != FONT_5X7[b], (a, b)
    assert set(DROP) == set("gjpqy") and LINE_HEIGHT == 9


@pytest.mark.parametrize("scale", [1, 2, 3])
def test_each_glyph_stays_inside_text_size(scale):
    width, height = text_size("A", scale)
    assert (width, height) == (5 * scale, 9 * scale)
    for character in FONT_5X7:
        canvas = Canvas(width + 6, height + 6, PAPER)
        canvas.draw_text(3, 3, character, INK, scale)
        pixels = inked(canvas)
        assert all(3 <= x < 3 + width and 3 <= y < 3 + height for x, y in pixels), character
        # a glyph keeps its 5 x 7 bitmap, moved down by its drop
        expected = {(3 + c * scale + i, 3 + (r + DROP.get(character, 0)) * scale + j)
                    for r, row in enumerate(FONT_5X7[character]) for c, bit in enumerate(row) if bit == "1"
                    for i in range(scale) for j in range(scale)}
        assert pixels == expected, character


def test_draw_text_of_a_line_fills_exactly_its_text_size_box():
    text = "Rank 7: stages 0,8 [p=4; 27.3%] g_y 'x' \"q\" (a+b)*c/d - e < f > h"
    width, height = text_size(text, 2)
    assert width == (len(text) * 6 - 1) * 2
    canvas = Canvas(width + 20, height + 20, PAPER)
    canvas.draw_text(10, 10, text, INK, 2)
    xs, ys = zip(*inked(canvas))
    # the first and last glyphs touch the box's sides, capitals its top, descenders (g, y, q) its bottom
    assert (min(xs), max(xs) + 1, min(ys), max(ys) + 1) == (10, 10 + width, 10, 10 + height)
    assert text_size("", 2) == (0, 0)


def test_glyphs_sit_one_blank_column_apart():
    canvas = Canvas(20, 9, PAPER)
    canvas.draw_text(0, 0, "||", INK)
    columns = sorted({x for x, _ in inked(canvas)})
    assert columns == [2, 8]  # "|" inks its middle column; the second starts 5 + 1 columns later


def test_unknown_characters_are_refused_by_name_and_printable_replaces_them():
    canvas = Canvas(100, 20, PAPER)
    with pytest.raises(ValueError, match=r"no glyph for '\\t', '€' in 'a€b\\tc'"):
        canvas.draw_text(0, 0, "a€b\tc", INK)
    assert canvas.pixels == Canvas(100, 20, PAPER).pixels  # nothing drawn before refusing
    assert printable("h100 €5\tx") == "h100 ?5?x"
    canvas.draw_text(0, 0, printable("a€b"), INK)
