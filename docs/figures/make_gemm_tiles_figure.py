"""Draw ``gemm_mma_tiles.png``: how ``gemm_mma``'s CTA tile sets the traffic of a prefill-sized GEMM.

Two panels, from ``fp8lab.numba_kernels.gemm_mma.Tiling`` alone (no GPU, no timing):

- **CTA tiles**: the default small-M tiling at M = 1,024 (``choose_tiling``), and three large-M tilings drawn to
  scale, each warp's ``16 m_blocks x 8 n8_tiles_per_warp`` block outlined.
- **Bytes moved per multiply-add** (both bars) at M = 1,024 on Qwen3-8B's q/k/v shape (N = 6,144, K = 4,096): every CTA reads
  its A rows (BF16) and its weight rows (E4M3) once per chunk, so the CTAs together read the activations
  ``ceil(N / CTA_N)`` times and the weights ``ceil(M / M_TILE)`` times; and the shared-memory bytes the warps read
  per mma (A fragments for every n8 tile column of warps, B codes for every m16 row of warps). The taller and wider
  the CTA, the fewer global bytes per FLOP.

Usage::

    python docs/figures/make_gemm_tiles_figure.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `fp8lab` importable
    sys.path.insert(0, str(ROOT))

from fp8lab.numba_kernels import gemm_mma as G  # noqa: E402

M, N, K = 1024, 6144, 4096
LARGE = [G.Tiling(4, 4, 4, 3, 2), G.Tiling(2, 4, 4, 3, 4), G.Tiling(4, 8, 4, 3, 1)]


def global_bytes_per_mac(t: G.Tiling) -> float:
    """Bytes the CTAs read from global memory (L2 or HBM) per multiply-add: A (2 bytes) once per CTA column, the
    codes (1 byte) once per CTA row."""
    columns, rows = -(-N // t.cta_n), -(-M // t.m_tile)
    return (2 * M * K * columns + N * K * rows) / (M * N * K)


def shared_bytes_per_mma(t: G.Tiling) -> float:
    """Shared-memory bytes a warp reads per ``mma.m16n8k16``: an A fragment (16 x 16 x 2 bytes) per m16 tile and
    B codes (8 x 16 bytes) per n8 tile, each k16 step, shared by the warp's ``m_blocks x n8_tiles_per_warp`` mma."""
    return (512 * t.m_blocks + 128 * t.n8_tiles_per_warp) / (t.m_blocks * t.n8_tiles_per_warp)


def draw_tile(ax, t: G.Tiling, x0: float, label: str) -> None:
    for w in range(t.warps_m * t.warps_n):
        wm, wn = divmod(w, t.warps_n)
        ax.add_patch(Rectangle((x0 + wn * 8 * t.n8_tiles_per_warp, wm * t.warp_rows), 8 * t.n8_tiles_per_warp,
                               t.warp_rows, facecolor=f"C{w % 10}", alpha=0.35, edgecolor="black", lw=0.6))
    ax.text(x0 + t.cta_n / 2, -8, label, ha="center", va="bottom", fontsize=7)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    default = G.choose_tiling(M, N, K)
    tilings = [default] + LARGE
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    x = 0.0
    for t in tilings:
        name = "default" if t == default else "large M"
        draw_tile(left, t, x, f"{name}\n{t.m_tile} x {t.cta_n}, {t.warps_m * t.warps_n} warps")
        x += t.cta_n + 24
    left.set_xlim(-8, x)
    left.set_ylim(140, -30)
    left.set_aspect("equal")
    left.set_xlabel("output columns (N) of one CTA; a box: one warp's m16 x n8 tiles")
    left.set_ylabel("output rows (M)")
    left.set_title(f"CTA tiles of gemm_mma (the default at M = {M}, and large-M tilings)", pad=24)

    labels = [f"{t.m_tile}x{t.cta_n}" for t in tilings]
    global_bytes = [global_bytes_per_mac(t) for t in tilings]
    shared_bytes = [shared_bytes_per_mma(t) / 2048 for t in tilings]  # an mma is 16 x 8 x 16 = 2048 multiply-adds
    positions = range(len(tilings))
    right.bar([p - 0.2 for p in positions], global_bytes, 0.4, label="global bytes per multiply-add")
    right.bar([p + 0.2 for p in positions], shared_bytes, 0.4, label="shared-memory bytes per multiply-add (a warp's fragments)")
    right.set_xticks(list(positions), labels)
    right.set_title(f"Bytes per multiply-add\n(M = {M}, N = {N}, K = {K})")
    right.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "gemm_mma_tiles.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
