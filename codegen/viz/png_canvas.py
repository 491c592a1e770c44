"""An RGB canvas of filled rectangles and 5x7-pixel text, written as PNG with zlib and struct only.

PNG layout (W3C PNG specification, 2nd edition): the 8-byte signature, then chunks of
``length | type | data | CRC-32 of type+data``: IHDR (width, height, bit depth 8, colour type 2 =
truecolour RGB, no interlace), one IDAT holding the zlib stream of every row prefixed by filter byte
0 (None), and IEND. That is all a viewer needs; no third-party imaging library is used.

Text uses the 5x7 bitmap font of ``font_5x7`` (letters, digits, punctuation), one blank column
between glyphs, drawn at an integer ``scale``: at scale 2 a character is 12 pixels wide and a line
18 high (14 for the glyph, 4 for the descent of g, j, p, q, y).
"""
from __future__ import annotations

import struct
import zlib

from xirang.codegen.viz.font_5x7 import DROP, FONT_5X7, GLYPH_SPACING, GLYPH_WIDTH, LINE_HEIGHT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Colour = tuple[int, int, int]


def text_size(text: str, scale: int = 1) -> tuple[int, int]:
    """Pixel width and height of ``text`` drawn at ``scale`` (what ``Canvas.draw_text`` covers)."""
    if not text:
        return 0, 0
    return (len(text) * (GLYPH_WIDTH + GLYPH_SPACING) - GLYPH_SPACING) * scale, LINE_HEIGHT * scale


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """A PNG file of ``width`` x ``height`` RGB pixels given row by row, 3 bytes each."""
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(f"encode_png needs width, height >= 1 and {width} x {height} x 3 = "
                         f"{width * height * 3} bytes of RGB, got {len(rgb)} bytes")
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[row * stride:(row + 1) * stride] for row in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))


class Canvas:
    """A width x height RGB image in memory; coordinates are pixels, (0, 0) at the top left."""

    def __init__(self, width: int, height: int, background: Colour = (255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, colour: Colour) -> None:
        """Fill the half-open box [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        if x1 <= x0:
            return
        row = bytes(colour) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            offset = (y * self.width + x0) * 3
            self.pixels[offset:offset + len(row)] = row

    def pixel(self, x: int, y: int) -> Colour:
        offset = (y * self.width + x) * 3
        return tuple(self.pixels[offset:offset + 3])

    def outline_rect(self, x0: int, y0: int, x1: int, y1: int, colour: Colour) -> None:
        """A one-pixel frame just inside the half-open box [x0, x1) x [y0, y1)."""
        for box in ((x0, y0, x1, y0 + 1), (x0, y1 - 1, x1, y1), (x0, y0, x0 + 1, y1), (x1 - 1, y0, x1, y1)):
            self.fill_rect(*box, colour)

    text_size = staticmethod(text_size)

    def draw_text(self, x: int, y: int, text: str, colour: Colour, scale: int = 1) -> None:
        """Draw ``text`` with its top-left corner at (x, y); it covers ``text_size(text, scale)``.
        A character the font has no glyph for is refused by name (``font_5x7.printable`` replaces them)."""
        unknown = sorted(set(text) - set(FONT_5X7))
        if unknown:
            marks = "".join(c for c in FONT_5X7 if not c.isalnum() and c != " ")
            raise ValueError(f"draw_text: no glyph for {', '.join(map(repr, unknown))} in {text!r}; the 5x7 "
                             f"font has A-Z a-z 0-9, space and {marks} (font_5x7.printable replaces the rest)")
        step = (GLYPH_WIDTH + GLYPH_SPACING) * scale
        for position, character in enumerate(text):
            left, top = x + position * step, y + DROP.get(character, 0) * scale
            for row, bits in enumerate(FONT_5X7[character]):
                for column, bit in enumerate(bits):
                    if bit == "1":
                        self.fill_rect(left + column * scale, top + row * scale,
                                       left + (column + 1) * scale, top + (row + 1) * scale, colour)

    def to_png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))
