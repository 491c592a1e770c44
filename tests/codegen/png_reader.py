"""Read back the PNGs codegen/png_canvas.py writes, checking the format on the way: the signature,
every chunk's CRC, 8-bit truecolour RGB without interlace, and filter byte 0 on every row."""
from __future__ import annotations

import struct
import zlib

from xirang.codegen.viz.png_canvas import PNG_SIGNATURE


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows, 3 bytes a pixel) of a PNG as png_canvas writes it."""
    assert data[:8] == PNG_SIGNATURE
    position, chunks = 8, {}
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length:position + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in chunk {kind}"
        chunks[kind] = chunks.get(kind, b"") + body
        position += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour_type, interlace) == (8, 2, 0) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    assert all(raw[row * stride] == 0 for row in range(height))
    return width, height, [raw[row * stride + 1:(row + 1) * stride] for row in range(height)]
