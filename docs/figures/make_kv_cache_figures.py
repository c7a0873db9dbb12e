"""Draw the paged KV cache figure of tutorial 06 from ``fp8lab.reference.kv_cache``.

- ``kv_cache_paged_layout.png``: the running example of the tutorial, a cache of 8 blocks of 4
  tokens. Left: the block tables of two sequences (11 and 6 tokens; ``-1`` pads a table row).
  Right: the physical cache, one row per block and one column per offset, each cell labelled with
  the sequence and token position it holds and its slot ``block * block_size + offset``; the two
  tokens that the decode step writes next are hatched, free slots are grey.

Usage::

    python docs/figures/make_kv_cache_figures.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `reference` importable
    sys.path.insert(0, str(ROOT))

from fp8lab.reference import kv_cache  # noqa: E402

LAYOUT_FILENAME = "kv_cache_paged_layout.png"

# The tutorial's running example (docs/06_fp8_kv_cache.md).
NUM_BLOCKS, BLOCK_SIZE = 8, 4
BLOCK_TABLES = np.array([[5, 2, 7], [0, 3, -1]], np.int32)
PROMPT_LENS = (11, 6)  # tokens in the cache before the decode step
COLORS = ("tab:blue", "tab:orange")


def draw_layout(out_dir: Path) -> Path:
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(10.5, 4.6), gridspec_kw={"width_ratios": [1, 1.55]})

    # (a) block tables: logical block i of sequence s -> physical block
    ax_t.set_xlim(-1.6, BLOCK_TABLES.shape[1])
    ax_t.set_ylim(BLOCK_TABLES.shape[0] + 0.2, -1.2)
    ax_t.axis("off")
    ax_t.set_title("block_tables [num_seqs, max_blocks_per_seq]", fontsize=10)
    for i in range(BLOCK_TABLES.shape[1]):
        ax_t.text(i + 0.5, -0.35, f"logical block {i}\n(positions {BLOCK_SIZE * i}-{BLOCK_SIZE * i + BLOCK_SIZE - 1})",
                  ha="center", va="center", fontsize=7.5)
    for s, row in enumerate(BLOCK_TABLES):
        ax_t.text(-0.15, s + 0.5, f"seq {s}\n({PROMPT_LENS[s]} + 1 tokens)", ha="right", va="center", fontsize=8.5)
        for i, block in enumerate(row):
            used = block >= 0
            ax_t.add_patch(Rectangle((i, s), 1, 1, facecolor=COLORS[s] if used else "white", alpha=0.35 if used else 1,
                                     edgecolor="black"))
            ax_t.text(i + 0.5, s + 0.5, str(block) if used else "-1\n(padding)", ha="center", va="center",
                      fontsize=11 if used else 8)

    # (b) the physical cache: [num_blocks, block_size] slots (per kv head, per element of head_dim)
    ax_c.set_xlim(-0.9, BLOCK_SIZE)
    ax_c.set_ylim(NUM_BLOCKS, -0.7)
    ax_c.axis("off")
    ax_c.set_title("cache [num_blocks, num_kv_heads, block_size, head_dim]: slot = block * block_size + offset",
                   fontsize=9)
    for offset in range(BLOCK_SIZE):
        ax_c.text(offset + 0.5, -0.3, f"offset {offset}", ha="center", va="center", fontsize=8)
    holder = {}
    for s, (row, length) in enumerate(zip(BLOCK_TABLES, PROMPT_LENS)):
        positions = np.arange(length + 1)
        for p, slot in zip(positions, kv_cache.slots_for_positions(row[row >= 0], positions, BLOCK_SIZE)):
            holder[int(slot)] = (s, int(p), p == length)
    for block in range(NUM_BLOCKS):
        ax_c.text(-0.1, block + 0.5, f"block {block}", ha="right", va="center", fontsize=8)
        for offset in range(BLOCK_SIZE):
            slot = block * BLOCK_SIZE + offset
            if slot in holder:
                s, p, new = holder[slot]
                ax_c.add_patch(Rectangle((offset, block), 1, 1, facecolor=COLORS[s], alpha=0.35, edgecolor="black",
                                         hatch="///" if new else None))
                label = f"seq {s}, pos {p}" + ("\n(written next)" if new else "")
            else:
                ax_c.add_patch(Rectangle((offset, block), 1, 1, facecolor="0.9", edgecolor="black"))
                label = "free"
            ax_c.text(offset + 0.5, block + 0.42, label, ha="center", va="center", fontsize=7)
            ax_c.text(offset + 0.95, block + 0.9, f"slot {slot}", ha="right", va="bottom", fontsize=6, color="0.3")

    fig.tight_layout()
    path = out_dir / LAYOUT_FILENAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    print(draw_layout(out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
