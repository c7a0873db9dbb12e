"""Draw ``prefill_mma_tiles.png``: how the tensor-core flash prefill cuts a prompt and masks one warp's last tile.

Two panels, a GQA group of 4 query heads (Qwen3-8B's), so 4 query tokens per warp
(``fp8lab.simulators.prefill_mma.tokens_per_warp``):

- **The walk**: a 40-token prompt, query tokens (rows) against key positions (columns). Each warp's 4 tokens are one
  band; the band is shaded over the 16-key chunks the warp computes (up to its last token's position), and the keys each
  token counts (the causal triangle) are dark. Inside a band, the light cells right of the triangle are keys the warp
  loaded that its earlier tokens do not count.
- **One warp's last chunk** (tokens 8 to 11, keys 0 to 15): the 16 mma rows are (token, head) pairs; a cell is the
  score of that row and key: counted (times ``k_scale[key]``, then a weight ``p * v_scale / 2^e`` in ``P V``), or
  ``-inf`` and weight 0 (after the row's position). The V scale ``2^e`` is the largest over the 12 loaded keys, one
  for all 16 rows (the warp's first tile: its running largest V scale).

Usage::

    python docs/figures/make_prefill_mma_figure.py [OUTPUT_DIR]

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

from fp8lab.simulators import prefill_mma  # noqa: E402
from fp8lab.simulators.splitkv_mma import TILE  # noqa: E402

GROUP = 4
PROMPT = 40


def walk_panel(ax):
    """Per query token and key: 2 counted, 1 loaded by the token's warp but after its position, 0 not loaded."""
    tokens = prefill_mma.tokens_per_warp(GROUP)
    query = np.arange(PROMPT)[:, None]
    key = np.arange(PROMPT)[None, :]
    warp_end = (query // tokens + 1) * tokens  # keys a warp loads: up to its last token's position
    loaded_tiles = -(-np.minimum(warp_end, PROMPT) // TILE) * TILE
    state = np.where(key <= query, 2, np.where(key < np.minimum(warp_end, PROMPT), 1, 0))
    state = np.where((state == 0) & (key < loaded_tiles), 0.4, state)  # tile padding past the warp's last key
    ax.imshow(state, cmap="Blues", vmin=0, vmax=2.2, interpolation="nearest")
    for edge in range(tokens, PROMPT, tokens):
        ax.axhline(edge - 0.5, color="white", lw=0.6)
    for edge in range(TILE, PROMPT, TILE):
        ax.axvline(edge - 0.5, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("key position (dashed: 16-key chunks)")
    ax.set_ylabel(f"query token (bands: one warp, {tokens} tokens)")
    ax.set_title(f"A {PROMPT}-token prompt: each warp walks its tiles alone")


def tile_panel(ax):
    """The mma rows (token, head) of the warp of tokens 8..11 against keys 0..15 (its last tile)."""
    tokens = prefill_mma.tokens_per_warp(GROUP)
    i0 = 8
    rows = np.arange(prefill_mma.ROWS)
    position = i0 + rows // GROUP
    key = np.arange(TILE)
    end = i0 + tokens  # the warp loads keys 0 .. 11
    counted = (key[None, :] <= position[:, None]) & (key[None, :] < end)
    loaded = np.broadcast_to(key[None, :] < end, counted.shape)
    ax.imshow(np.where(counted, 2, np.where(loaded, 1, 0)), cmap="Blues", vmin=0, vmax=2.2, interpolation="nearest")
    for r in rows:
        for j in key:
            label = "s" if counted[r, j] else ("0" if loaded[r, j] else "")
            ax.text(j, r, label, ha="center", va="center", fontsize=6, color="white" if counted[r, j] else "black")
    ax.set_yticks(rows, [f"t{i0 + r // GROUP} h{r % GROUP}" for r in rows], fontsize=6)
    ax.set_xticks(key, [str(j) for j in key], fontsize=6)
    ax.set_xlabel("key: k_scale on its scores, v_scale / 2^e on its weights\n(2^e from the largest v_scale of keys 0..11)")
    ax.set_title("Tokens 8-11, last tile: s counted,\n0 weight 0 (after the row's position)")


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [1.25, 1]})
    walk_panel(axes[0])
    tile_panel(axes[1])
    fig.tight_layout()
    fig.savefig(out_dir / "prefill_mma_tiles.png", dpi=130)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
