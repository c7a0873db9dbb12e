"""Draw the split-kv figures of tutorial 04 from ``fp8lab.simulators.splitkv``.

- ``splitkv_partials.png``: one sequence of 150 tokens cut into 6 shards (the last one empty),
  one query head with ALiBi. Top: every token's score in the log2 domain, coloured by shard, with
  each shard's running max ``m_s`` and the overall ``m*``. Bottom left: each shard's ``l_s`` and its
  combine weight ``w_s = exp2(m_s - m*)``. Bottom right: each shard's own normalized output
  ``acc_s / l_s``, the combined output and the float64 reference, for the first head dims.
- ``splitkv_error.png``: the error against ``fp8lab.reference.attention.paged_decode`` as the number of
  splits goes from 1 to 8, for an FP8 and a float32 cache.

Usage::

    python docs/figures/make_splitkv_figures.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `reference` importable
    sys.path.insert(0, str(ROOT))

from fp8lab.reference import attention, kv_cache  # noqa: E402
from fp8lab.reference import strategies as fst  # noqa: E402
from fp8lab.simulators import splitkv  # noqa: E402

PARTIALS_FILENAME = "splitkv_partials.png"
ERROR_FILENAME = "splitkv_error.png"


def one_sequence(rng, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_seqs: int = 1, fp8: bool = True):
    """Random paged caches for ``num_seqs`` sequences of ``seq_len`` tokens, blocks in shuffled order."""
    blocks = -(-seq_len // block_size)
    tables = rng.permutation(num_seqs * blocks).reshape(num_seqs, blocks).astype(np.int32)
    layout = fst.PagedKVLayout(num_heads, num_kv_heads, head_dim, block_size, num_seqs * blocks, tables,
                               np.full(num_seqs, seq_len, np.int32))
    return layout.random_data(rng, fp8=fp8)


def scores_log2(data, slopes, head: int) -> np.ndarray:
    """Exact (float64) log2-domain scores of sequence 0, query head ``head``."""
    length = int(data.seq_lens[0])
    group = data.q.shape[1] // data.k_cache.shape[1]
    k = kv_cache.gather(data.k_cache, data.k_scale, data.block_tables[0], length).astype(np.float64)[:, head // group]
    s = k @ data.q[0, head].astype(np.float64) * data.softmax_scale
    s += slopes[head] * (np.arange(length) - (length - 1))
    return s * math.log2(math.e)


def draw_partials(out_dir: Path) -> Path:
    rng = np.random.default_rng(4)
    seq_len, block_size, num_splits, head = 150, 16, 6, 0
    data = one_sequence(rng, seq_len, num_heads=2, num_kv_heads=1, head_dim=32, block_size=block_size)
    slopes = np.array([0.03, 0.06], np.float32)
    parts = splitkv.shard_partials(*data.decode_args(), alibi_slopes=slopes, num_splits=num_splits)
    m, l = parts.m[0, head], parts.l[0, head]
    own = parts.shard_outputs()[0, head]
    out = splitkv.combine_partials(parts.m, parts.l, parts.acc)[0, head]
    ref = attention.paged_decode(*data.decode_args(), alibi_slopes=slopes)[0, head]
    m_star, w = splitkv.merge_weights(m)
    s = scores_log2(data, slopes, head)
    colors = plt.get_cmap("tab10")(np.arange(num_splits))

    fig = plt.figure(figsize=(11, 7.2))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.1, 1], width_ratios=[1, 1.35])
    ax_s = fig.add_subplot(grid[0, :])
    ax_w = fig.add_subplot(grid[1, 0])
    ax_o = fig.add_subplot(grid[1, 1])

    # (a) scores per token, shard by shard, with each shard's max m_s
    for shard, (start, end) in enumerate(parts.bounds[0]):
        if end > start:
            tokens = np.arange(start, end)
            ax_s.plot(tokens, s[start:end], ".", color=colors[shard], ms=5, label=f"shard {shard}: [{start}, {end})")
            ax_s.hlines(m[shard], start - 0.5, end - 0.5, color=colors[shard], lw=2.5)
        else:
            ax_s.plot([], [], ".", color=colors[shard], label=f"shard {shard}: empty, m = -inf")
        ax_s.axvline(start - 0.5, color="gray", lw=0.6, ls=":")
    ax_s.axhline(m_star, color="black", lw=1, ls="--", label="m* = max m_s")
    ax_s.set_xlim(-2, seq_len + 1)
    ax_s.set_ylim(np.min(s) - 14, max(np.max(s), m_star) + 3)  # room for the legend below the points
    ax_s.set_xlabel("token j")
    ax_s.set_ylabel("score s_j (log2 domain)")
    ax_s.set_title(f"{seq_len} tokens, blocks of {block_size}, {num_splits} splits: each shard keeps its own max "
                   "m_s (thick), sum l_s and unnormalized acc_s", fontsize=10)
    ax_s.legend(fontsize=7.5, ncols=4, loc="lower center", frameon=False)

    # (b) the combine weights: w_s = exp2(m_s - m*), and each shard's share w_s l_s / sum
    x = np.arange(num_splits)
    share = w * l / np.sum(w * l)
    ax_w.bar(x - 0.2, w, width=0.4, color=colors, alpha=0.45, label="w_s = exp2(m_s - m*)")
    ax_w.bar(x + 0.2, share, width=0.4, color=colors, edgecolor="black", label="w_s l_s / sum (share of the softmax)")
    for shard in np.flatnonzero(l == 0):
        ax_w.annotate("empty:\n(-inf, 0, 0)\nweight 0", (shard, 0.02), ha="center", fontsize=7.5)
    ax_w.set_xticks(x)
    ax_w.set_xticklabels([f"shard {i}" for i in x], fontsize=8)
    ax_w.set_ylim(0, 1.15)
    ax_w.set_title("combine weights", fontsize=10)
    ax_w.legend(fontsize=7.5, frameon=False, loc="upper left")

    # (c) outputs: each shard's own, the combine, the reference
    dims = np.arange(12)
    for shard in np.flatnonzero(l > 0):
        ax_o.plot(dims, own[shard, dims], "-", color=colors[shard], lw=1, alpha=0.7)
    ax_o.plot(dims, out[dims], "-", color="black", lw=2.2, label="combine: sum w_s acc_s / sum w_s l_s")
    ax_o.plot(dims, ref[dims], "x", color="red", ms=7, label="reference (float64)")
    ax_o.plot([], [], "-", color="gray", lw=1, label="each shard's own acc_s / l_s")
    ax_o.set_xlabel("head dim d")
    ax_o.set_ylabel("output")
    ax_o.set_title(f"outputs (first {len(dims)} dims); max |combine - ref| = {np.max(np.abs(out - ref)):.1e}",
                   fontsize=10)
    ax_o.legend(fontsize=7.5, frameon=False)

    fig.tight_layout()
    path = out_dir / PARTIALS_FILENAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def errors_by_splits(fp8: bool, split_counts, seeds=(0, 1, 2)) -> np.ndarray:
    """Max |out - ref| / max |v| over a batch (4 sequences of 384 tokens, 4 heads, GQA 2), per split count."""
    errors = np.zeros((len(seeds), len(split_counts)))
    for i, seed in enumerate(seeds):
        rng = np.random.default_rng(100 + seed)
        data = one_sequence(rng, 384, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_seqs=4, fp8=fp8)
        ref = attention.paged_decode(*data.decode_args()).astype(np.float64)
        v_max = max(np.max(np.abs(kv_cache.gather(data.v_cache, data.v_scale, t, 384))) for t in data.block_tables)
        for j, splits in enumerate(split_counts):
            out = splitkv.paged_decode(*data.decode_args(), num_splits=splits)
            errors[i, j] = np.max(np.abs(out - ref)) / v_max
    return errors


def draw_error(out_dir: Path) -> Path:
    split_counts = np.arange(1, 9)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for fp8, color, label in ((True, "tab:blue", "FP8 cache"), (False, "tab:orange", "float32 cache")):
        errors = errors_by_splits(fp8, split_counts)
        ax.plot(split_counts, errors.mean(axis=0), "o-", color=color, label=f"{label} (mean of 3 batches)")
        ax.fill_between(split_counts, errors.min(axis=0), errors.max(axis=0), color=color, alpha=0.2)
    ax.axhline(2.0**-24, color="gray", ls=":", lw=1)
    ax.annotate("float32 unit roundoff $2^{-24}$", (8, 2.0**-24), ha="right", va="bottom", fontsize=8, color="gray")
    ax.set_yscale("log", base=2)
    ax.set_ylim(2.0**-27, 2.0**-17)
    ax.set_xlabel("num_splits")
    ax.set_ylabel("max |out - ref| / max |v|")
    ax.set_title("split-kv in float32 against the float64 reference: 384 tokens, head_dim 64", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out_dir / ERROR_FILENAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    print(draw_partials(out_dir))
    print(draw_error(out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
