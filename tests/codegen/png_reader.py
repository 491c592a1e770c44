"""Read back the PNG pictures (drawn by matplotlib, codegen/viz) as plain RGB rows, decoded by
matplotlib's own reader, so that tests can look at pixels."""
from __future__ import annotations

from io import BytesIO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows, 3 bytes a pixel) of PNG ``data``; alpha, if any, must be opaque."""
    import numpy as np
    from matplotlib.image import imread
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    image = imread(BytesIO(data), format="png")
    if image.dtype != np.uint8:  # PNGs decode to floats in 0..1
        image = np.round(image * 255).astype(np.uint8)
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    if image.shape[2] == 4:
        assert (image[:, :, 3] == 255).all(), "the picture has transparent pixels"
    height, width = image.shape[:2]
    return width, height, [row.tobytes() for row in np.ascontiguousarray(image[:, :, :3])]


def colours(rows: list[bytes]) -> set[tuple[int, int, int]]:
    """Every distinct RGB colour of the picture."""
    import numpy as np
    pixels = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(-1, 3)
    return {tuple(int(c) for c in colour) for colour in np.unique(pixels, axis=0)}
