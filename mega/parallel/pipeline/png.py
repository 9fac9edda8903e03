"""A simulated schedule as a PNG image, with no imaging library (``zlib`` and ``struct`` only).

One horizontal lane per rank, time to the right. Each compute action is a box coloured by its
micro-batch (hues spread by the golden ratio): forwards light, backwards dark and saturated.
With several chunks a strip along the top of each box shades the chunk (darker = later chunk).
Idle time is light grey. The file is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import colorsys
import os
import struct
import zlib
from pathlib import Path

from mega.parallel.pipeline.actions import label
from mega.parallel.pipeline.simulate import SimulationResult

Colour = tuple[int, int, int]

LANE = 28  # pixels per rank lane
GAP = 6  # pixels between lanes
MARGIN = 8
MAX_WIDTH = 4000
IDLE: Colour = (232, 232, 232)
BACKGROUND: Colour = (255, 255, 255)
GOLDEN = 0.618033988749895


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """An 8-bit RGB PNG of ``width`` x ``height`` pixels from row-major ``rgb`` bytes."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"expected {width * height * 3} bytes of RGB, got {len(rgb)}")

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def action_colour(microbatch: int, kind: str) -> Colour:
    """Light for a forward (``"F"``), dark for a backward (``"B"``), between for its split-off
    weight gradients (``"W"``); the hue set by the micro-batch."""
    hue = (microbatch * GOLDEN) % 1.0
    saturation, value = {"F": (0.35, 0.97), "B": (0.85, 0.62), "W": (0.6, 0.8)}[kind]
    return tuple(round(c * 255) for c in colorsys.hsv_to_rgb(hue, saturation, value))


def timeline_image(result: SimulationResult) -> tuple[int, int, bytes]:
    """``(width, height, rgb)`` of the timeline picture."""
    total = result.total_time or 1.0
    scale = max(1.0, min(40.0, (MAX_WIDTH - 2 * MARGIN) / total))  # pixels per time unit
    width = int(total * scale) + 2 * MARGIN
    height = result.pp * (LANE + GAP) - GAP + 2 * MARGIN
    pixels = bytearray(bytes(BACKGROUND) * (width * height))

    def fill(x0: int, x1: int, y0: int, y1: int, colour: Colour) -> None:
        row = bytes(colour) * max(0, x1 - x0)
        for y in range(y0, y1):
            start = (y * width + x0) * 3
            pixels[start : start + len(row)] = row

    for rank in range(result.pp):
        top = MARGIN + rank * (LANE + GAP)
        fill(MARGIN, width - MARGIN, top, top + LANE, IDLE)
        for slot in result.timelines.get(rank, []):
            x0 = MARGIN + int(round(slot.start * scale))
            x1 = MARGIN + int(round(slot.end * scale))
            kind = label(slot.action)[0]
            fill(x0, x1, top, top + LANE, action_colour(slot.action.microbatch, kind))
            if result.vpp > 1:
                shade = 200 - round(160 * slot.action.chunk / (result.vpp - 1))
                fill(x0, x1, top, top + 5, (shade, shade, shade))
            if x1 - x0 >= 3:  # a thin white edge keeps neighbouring boxes apart
                fill(x1 - 1, x1, top, top + LANE, BACKGROUND)
    return width, height, bytes(pixels)


def write_timeline_png(result: SimulationResult, path: str | os.PathLike) -> Path:
    """Write the timeline picture to ``path`` atomically; returns the path."""
    target = Path(path)
    data = encode_png(*timeline_image(result))
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target
