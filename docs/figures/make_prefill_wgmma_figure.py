"""Draw ``prefill_wgmma_buffers.png``: the two shared-memory buffers the warpgroup flash prefill decodes a tile into.

``fp8lab.numba_kernels.prefill_wgmma`` converts each E4M3 code of a 64-key tile once, into F16 in the layout Hopper's
``wgmma`` reads its B operand in: 128-byte rows of 8 pieces of 16 bytes (8 F16 values), 8 rows to a 1,024-byte atom,
piece ``p`` of row ``r`` stored in slot ``p ^ (r % 8)`` (the 128-byte swizzle: a quarter-warp's 16-byte accesses fall
in 8 different bank groups). Two panels, the first 8 rows of each buffer:

- **K buffer** (the scores' B: one row per key, 128 head positions in two 64-wide atoms; atom 0 drawn). Position
  ``16 s + k`` holds head element ``score_dims[s, k]`` (the tensor-core decode's k-step order), so logical piece
  ``p`` holds k-step ``p // 2``'s elements ``32 t + 4 s + 2 (p % 2) + {0, 1}`` for ``t = 0 .. 3``. The codes are
  decoded exactly (no scale): the key's ``k_scale`` multiplies its score column after the ``wgmma``.
- **V buffer** (``P V``'s B, transposed: one row per head element, the tile's 64 keys in order). Row ``n`` holds
  element ``4 (n % 32) + n // 32``; piece ``q`` holds keys ``8 q .. 8 q + 7``, written by one thread of warp ``q // 2``
  (one warpgroup). The ``v_scale`` of each key is not here: it goes into that key's weight, ``p * v_scale / 2^e``.

Each cell is a 16-byte piece in its physical slot, labelled with the logical piece it holds.

Usage::

    python docs/figures/make_prefill_wgmma_figure.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `fp8lab` importable
    sys.path.insert(0, str(ROOT))

from fp8lab.simulators.splitkv_mma import score_dims  # noqa: E402

ROWS, PIECES = 8, 8


def swizzled(row: int, piece: int) -> int:
    """The slot of logical piece ``piece`` in swizzle row ``row``."""
    return piece ^ (row % 8)


def draw_pieces(ax, piece_label, piece_color, cmap, vmax, row_labels, title):
    """One buffer's first 8 swizzle rows: logical piece ``p`` of row ``r`` drawn in its slot, coloured
    ``piece_color(r, p)`` (``cmap`` over ``0 .. vmax``) and labelled ``piece_label(r, p)``."""
    color = np.zeros((ROWS, PIECES))
    for row in range(ROWS):
        for piece in range(PIECES):
            slot = swizzled(row, piece)
            color[row, slot] = piece_color(row, piece)
            ax.text(slot, row, piece_label(row, piece), ha="center", va="center", fontsize=6.5)
    ax.imshow(color, cmap=cmap, vmin=0, vmax=vmax, alpha=0.6, interpolation="nearest")
    ax.set_xticks(range(PIECES), [f"slot {c}" for c in range(PIECES)], fontsize=7)
    ax.set_yticks(range(ROWS), row_labels, fontsize=7)
    ax.set_title(title, fontsize=8)


def key_panel(ax):
    """Atom 0 of the K buffer: keys 0..7, head positions 0..63 (k-steps 0..3)."""
    dims = score_dims(128)

    def label(key, piece):
        step, half = piece // 2, piece % 2
        return f"p{piece}\nd{int(dims[step, 8 * half])}+"  # positions 16 s + 8 h ..: pairs for lanes t = 0 .. 3

    draw_pieces(ax, label, lambda key, piece: piece, "tab10", 10, [f"key {k}" for k in range(ROWS)],
                "K buffer, atom 0 (positions 0..63). Piece p: k-step s = p // 2, head elements\n"
                "32 t + 4 s + 2 (p % 2) + {0, 1} for t = 0..3 (labelled d: t = 0's first)")


def value_panel(ax):
    """The first 8 rows of the V buffer: head elements 0, 4, ..., 28 (rows 0..7), the tile's keys in 8 pieces,
    coloured by the warp that writes them (one warpgroup: keys ``16 w .. 16 w + 15``)."""
    draw_pieces(ax, lambda row, piece: f"k{8 * piece}+\nw{piece // 2}", lambda row, piece: piece // 2, "Set2", 8,
                [f"row {r}: d{4 * r}" for r in range(ROWS)],
                "V buffer, rows 0..7 (row n: head element 4 (n % 32) + n // 32). Piece q:\n"
                "keys 8 q .. 8 q + 7 (labelled k), written by warp q // 2 (w)")


def main(out_dir: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    key_panel(axes[0])
    value_panel(axes[1])
    fig.suptitle("prefill_wgmma: a tile decoded once per CTA into wgmma's swizzled B layout "
                 "(piece p in slot p ^ row % 8)", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "prefill_wgmma_buffers.png"
    fig.savefig(path, dpi=140)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
