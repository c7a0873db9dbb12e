"""Draw ``splitkv_mma_tiles.png``: what one warp of the tensor-core decode attention holds for a 16-token tile.

Three panels, head_dim 128, a GQA group of 4 query heads (Qwen3-8B's):

- **A key row** (128 E4M3 codes): coloured by the lane group ``t`` whose load holds them (lane ``(g, t)`` loads
  bytes ``[32 t, 32 t + 32)`` of key rows ``g`` and ``8 + g``); each cell labelled with the k-step ``s`` that sums
  it (``fp8lab.simulators.splitkv_mma.score_dims``): word ``s`` of a lane's bytes is that step's B registers.
- **The scores** ``S [16 rows, 16 tokens]``: rows are the query heads (rows 4..15 zeros), each cell labelled with
  the lane that holds it in the accumulator; token ``j``'s column is multiplied by ``k_scale[j]``. The same cells,
  as F16 weights ``p * v_scale / 2^e``, are the A registers of ``P V``.
- **A value tile** ``V [16 tokens, 128]``: coloured by the lane group ``g`` whose load holds the elements
  (``[16 g, 16 g + 16)`` of tokens ``2t, 2t + 1, 2t + 8, 2t + 9``); n tile ``s`` multiplies element ``16 n + s`` of
  each group ``n``.

Usage::

    python docs/figures/make_splitkv_mma_figure.py [OUTPUT_DIR]

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

from fp8lab.simulators import mma, splitkv_mma  # noqa: E402

FILENAME = "splitkv_mma_tiles.png"
HEAD_DIM, GROUP = 128, 4
T_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]


def key_steps() -> np.ndarray:
    """``step [128]``: the k-step of the score mma that sums each head element."""
    step = np.empty(HEAD_DIM, int)
    for s, dims in enumerate(splitkv_mma.score_dims(HEAD_DIM)):
        step[dims] = s
    return step


def draw(out_dir: Path) -> Path:
    fig = plt.figure(figsize=(14, 9))
    keys = fig.add_axes([0.05, 0.80, 0.9, 0.11])
    scores = fig.add_axes([0.07, 0.12, 0.33, 0.56])
    values = fig.add_axes([0.55, 0.12, 0.43, 0.56])

    step = key_steps()
    for d in range(HEAD_DIM):
        keys.add_patch(plt.Rectangle((d, 0), 1, 1, facecolor=T_COLOURS[d // 32], alpha=0.4, edgecolor="white"))
        keys.text(d + 0.5, 0.5, str(step[d]), ha="center", va="center", fontsize=5)
    for t in range(4):
        keys.text(32 * t + 16, 1.2, f"lane group t = {t}: bytes [{32 * t}, {32 * t + 32})", ha="center", fontsize=8,
                  color=T_COLOURS[t])
    keys.set_xlim(0, HEAD_DIM)
    keys.set_ylim(0, 1.6)
    keys.set_yticks([])
    keys.set_xlabel("a key row's 128 E4M3 codes; each cell: the k-step s whose mma sums it (word s of the lane's bytes)")

    owner = mma.C_OWNERS  # [16, 8, 2]: (lane, index) of each accumulator element
    for row in range(16):
        for token in range(16):
            lane = owner[row, token % 8, 0]
            real = row < GROUP
            colour = T_COLOURS[lane & 3] if real else "lightgrey"
            scores.add_patch(plt.Rectangle((token, 15 - row), 1, 1, facecolor=colour, alpha=0.4 if real else 0.5,
                                           edgecolor="white"))
            if real:
                scores.text(token + 0.5, 15.5 - row, str(lane), ha="center", va="center", fontsize=7)
    scores.text(8, 16.3, "x k_scale[token] on each column", ha="center", fontsize=8)
    scores.text(8, 5.5, f"rows {GROUP}..15: zero queries\n(a GQA group of {GROUP})", ha="center", fontsize=8)
    scores.set_xlim(0, 16)
    scores.set_ylim(0, 17)
    scores.set_xticks(np.arange(16) + 0.5)
    scores.set_xticklabels([str(j) for j in range(16)], fontsize=7)
    scores.set_yticks(np.arange(16) + 0.5)
    scores.set_yticklabels([f"row {15 - r}" for r in range(16)], fontsize=7)
    scores.set_xlabel("token of the tile; each cell: the lane holding S,\nthen the F16 weight p v_scale / 2^e")
    scores.set_title("scores S = Q K^T and weights P: the accumulator layout is P's A layout", fontsize=9)

    width = HEAD_DIM // 8
    for token in range(16):
        t = (token % 8) // 2  # the lane group t that loads this token's value bytes
        for group in range(8):
            values.add_patch(plt.Rectangle((group * width, 15 - token), width, 1, facecolor=T_COLOURS[t],
                                           alpha=0.15 + 0.06 * group, edgecolor="white"))
    for group in range(8):
        values.text(group * width + width / 2, 16.3, f"g = {group}", ha="center", fontsize=7)
    values.set_xlim(0, HEAD_DIM)
    values.set_ylim(0, 17)
    values.set_yticks(np.arange(16) + 0.5)
    values.set_yticklabels([f"token {15 - j} (t = {((15 - j) % 8) // 2})" for j in range(16)], fontsize=7)
    values.set_xticks(np.arange(0, HEAD_DIM + 1, width))
    values.set_xlabel("head element; lane (g, t) loads [16 g, 16 g + 16) of tokens 2t, 2t+1, 2t+8, 2t+9;\n"
                      "n tile s multiplies element 16 n + s of each group n: one mma per s, 16 a tile")
    values.set_title("values V: the B registers pair two tokens at one element (bytes gathered, then converted)",
                     fontsize=9)
    fig.suptitle("splitkv_mma: one warp, one 16-token tile, head_dim 128 (fp8lab.simulators.splitkv_mma)")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILENAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
