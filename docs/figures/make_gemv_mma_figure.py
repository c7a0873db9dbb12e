"""Draw ``gemv_mma_k_order.png``: which k each k16 step of the tensor-core GEMV sums, and who loads them.

One 64-wide span of K (the unit of ``fp8lab.simulators.gemv_mma.k_order``). Top: the span's 64 k as one row of
cells, coloured by the lane group ``t`` whose 128-bit load holds them (lane ``(g, t)`` loads bytes
``[16 t, 16 t + 16)`` of its weight rows and the same k of its activation row), each cell labelled with the k16
step ``j`` that sums it. Bottom: the 4 steps as rows of 16 fragment positions, each cell labelled with its k: what
the mma of step ``j`` multiplies, positions ``2t, 2t + 1, 2t + 8, 2t + 9`` held by lane group ``t``. Contiguous k
per lane (one load) on top; the mma's fragment layout below; ``k_order`` is the map between them.

Usage::

    python docs/figures/make_gemv_mma_figure.py [OUTPUT_DIR]

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

from fp8lab.simulators import gemv_mma  # noqa: E402

FILENAME = "gemv_mma_k_order.png"
COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]


def span_layout() -> tuple[np.ndarray, np.ndarray]:
    """``steps [4, 16]``: the k at each fragment position of each step of span 0; ``step_of_k [64]``: which
    step sums each k."""
    steps = gemv_mma.k_order(64).reshape(4, 16)
    step_of_k = np.empty(64, int)
    for j, row in enumerate(steps):
        step_of_k[row] = j
    return steps, step_of_k


def draw(out_dir: Path) -> Path:
    steps, step_of_k = span_layout()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 5.2), height_ratios=[1, 2.2])

    for k in range(64):  # top: the span's k in memory order, coloured by the lane group that loads them
        top.add_patch(plt.Rectangle((k, 0), 1, 1, facecolor=COLOURS[k // 16], alpha=0.35, edgecolor="white"))
        top.text(k + 0.5, 0.5, str(step_of_k[k]), ha="center", va="center", fontsize=7)
    for t in range(4):
        top.text(16 * t + 8, 1.15, f"lane group t = {t}: one 128-bit load", ha="center",
                 fontsize=8, color=COLOURS[t])
    top.set_xlim(0, 64)
    top.set_ylim(0, 1.5)
    top.set_yticks([])
    top.set_xticks(range(0, 65, 8))
    top.set_xlabel("k within the span (memory order); each cell: the k16 step j that sums it")

    for j in range(4):  # bottom: each step's 16 fragment positions, labelled with their k
        for f in range(16):
            k = steps[j, f]
            y = 3 - j
            bottom.add_patch(plt.Rectangle((f, y), 1, 1, facecolor=COLOURS[k // 16], alpha=0.35, edgecolor="white"))
            bottom.text(f + 0.5, y + 0.5, str(k), ha="center", va="center", fontsize=8)
    bottom.set_xlim(0, 16)
    bottom.set_ylim(0, 4)
    bottom.set_xticks(np.arange(16) + 0.5)
    bottom.set_xticklabels([str(f) for f in range(16)], fontsize=8)
    bottom.set_yticks(np.arange(4) + 0.5)
    bottom.set_yticklabels([f"step j = {3 - i}" for i in range(4)])
    bottom.set_xlabel("mma fragment position (lane group t holds 2t, 2t + 1, 2t + 8, 2t + 9); each cell: its k")
    fig.suptitle("gemv_mma: each k16 step sums 4 of the 16 k each lane group loaded (fp8lab.simulators.gemv_mma.k_order)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILENAME
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else HERE
    print(draw(out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
