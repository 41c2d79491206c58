import numpy as np


def padded(rows: list[list[int]], pad: int, dtype=np.int64) -> np.ndarray:
    """[len(rows), longest row (at least 1)] of dtype, each row right-padded with pad."""
    out = np.full((len(rows), max(1, max(len(r) for r in rows))), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out
