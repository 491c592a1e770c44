"""An RGB canvas of filled rectangles and 3x5-pixel text, written as PNG with zlib and struct only.

PNG layout (W3C PNG specification, 2nd edition): the 8-byte signature, then chunks of
``length | type | data | CRC-32 of type+data``: IHDR (width, height, bit depth 8, colour type 2 =
truecolour RGB, no interlace), one IDAT holding the zlib stream of every row prefixed by filter byte
0 (None), and IEND. That is all a viewer needs; no third-party imaging library is used.

The font covers the digits and the few letters timeline labels use (F B I W c r s); each glyph is
3 pixels wide and 5 high, drawn at an integer ``scale``.
"""
from __future__ import annotations

import struct
import zlib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Colour = tuple[int, int, int]

FONT_3X5 = {
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    "F": ("111", "100", "110", "100", "100"), "B": ("110", "101", "110", "101", "110"),
    "I": ("111", "010", "010", "010", "111"), "W": ("101", "101", "111", "111", "101"),
    "c": ("000", "111", "100", "100", "111"), "r": ("000", "111", "100", "100", "100"),
    "s": ("011", "100", "010", "001", "110"), " ": ("000", "000", "000", "000", "000"),
}
GLYPH_WIDTH, GLYPH_HEIGHT, GLYPH_SPACING = 3, 5, 1


def text_size(text: str, scale: int) -> tuple[int, int]:
    """Pixel width and height of ``text`` drawn at ``scale``."""
    if not text:
        return 0, 0
    return (len(text) * (GLYPH_WIDTH + GLYPH_SPACING) - GLYPH_SPACING) * scale, GLYPH_HEIGHT * scale


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

    def draw_text(self, x: int, y: int, text: str, colour: Colour, scale: int = 1) -> None:
        """Draw ``text`` with its top-left corner at (x, y); characters outside FONT_3X5 are refused."""
        unknown = sorted(set(text) - set(FONT_3X5))
        if unknown:
            raise ValueError(f"draw_text: no glyph for {unknown} in {text!r}; the built-in font has "
                             f"{''.join(sorted(FONT_3X5)).strip()}")
        for position, character in enumerate(text):
            left = x + position * (GLYPH_WIDTH + GLYPH_SPACING) * scale
            for row, bits in enumerate(FONT_3X5[character]):
                for column, bit in enumerate(bits):
                    if bit == "1":
                        self.fill_rect(left + column * scale, y + row * scale,
                                       left + (column + 1) * scale, y + (row + 1) * scale, colour)

    def to_png(self) -> bytes:
        return encode_png(self.width, self.height, bytes(self.pixels))
