import numpy as np


def padded(rows: list[list[int]], pad: int, dtype=np.int64) -> np.ndarray:
    """[len(rows), longest row (at least 1)] of dtype, each row right-padded with pad."""
    out = np.full((len(rows), max(1, max(len(r) for r in rows))), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def aligned_offsets(sizes: list[int], align: int) -> tuple[list[int], int]:
    """Byte sizes laid back to back, each starting at a multiple of align -> (each one's offset,
    total bytes)."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // align) * align
    return offsets, total
