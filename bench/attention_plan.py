"""The split-kv decode plan on the GPU: heads per CTA and CTAs per SM against batch and context.

    python bench/attention_plan.py [--previous-tree DIR]

What ``fp8lab.simulators.splitkv.heads_per_cta`` and ``choose_num_splits`` were chosen from. For the Qwen3-8B
heads (32 query, 8 kv) and the Qwen3-0.6B heads (16 query, 8 kv), head_dim 128, FP8 cache, block size 16,
batches 1 to 16 and contexts 512 to 16,384, one decode attention (the split kernel, then the combine kernel)
is timed by CUDA-graph replay for each of 1, 2 and 4 heads per CTA (those that divide the GQA group) and
"auto"'s split rule aimed at 1 and at 2 CTAs per SM. Every sequence's blocks are drawn at random from a
600 MB pool of random K/V written by ``paged_cache_write``, a fresh draw per replayed launch, so K and V
come from HBM, not from the L2. Before timing, each variant's output (poisoned with NaN first) must be
finite, and equal bit for bit to every other variant with the same split count (heads per CTA change no
bit). Prints one markdown table per head shape; a cell is ``us (splits)``.

``--previous-tree DIR``: also time the plan of 2026-12-02 (the largest divisor of the group up to 4 heads
per CTA, 1 CTA per SM) with the combine kernel of an older checkout of this repository (its
``fp8lab/numba_kernels/splitkv.py``, whose ``combine_kernel`` takes the 4-D workspace), checked to give
the same bits as the same plan with this checkout's combine.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

HEAD_DIM, BLOCK_SIZE = 128, 16
MAX_SPLITS_PER_HEAD = 8  # fp8lab.simulators.splitkv's; the rule is written out here to time the rules it did not choose
POOL_BYTES = 600e6
HEAD_SHAPES = ((32, 8), (16, 8))
CASES = ((1, (512, 1024, 2048, 4096, 8192, 16384)), (2, (512, 2048, 8192)), (4, (512, 1024, 2048, 4096, 8192)),
         (8, (512, 2048, 4096)), (16, (512, 1024, 2048)))
"""``(batch, contexts)`` timed."""
HEADS = (4, 2, 1)
CTAS_PER_SM = (1, 2)
COPIES = 40
"""Block-table draws a timed graph rotates among."""


def previous_splitkv(tree: Path):
    """The ``splitkv`` module of an older checkout, imported beside this one's (it shares this package's helpers)."""
    name = "fp8lab.numba_kernels.splitkv_previous"
    spec = importlib.util.spec_from_file_location(name, str(tree / "fp8lab/numba_kernels/splitkv.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cache_pool(num_kv_heads: int, torch, cuda):
    """``(num_blocks, k_words, v_words, k_scales, v_scales)``: an FP8 cache of ``POOL_BYTES`` of random K/V."""
    from fp8lab.numba_kernels import splitkv
    from fp8lab.numba_kernels.kv_cache import paged_cache_write

    num_blocks = int(POOL_BYTES // (num_kv_heads * BLOCK_SIZE * (2 * HEAD_DIM + 8)))
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    k, v = cuda.device_array(shape, np.uint8), cuda.device_array(shape, np.uint8)
    k_scales, v_scales = cuda.device_array(shape[:3], np.float32), cuda.device_array(shape[:3], np.float32)
    chunk = 16384
    for first in range(0, num_blocks * BLOCK_SIZE, chunk):
        n = min(chunk, num_blocks * BLOCK_SIZE - first)
        slots = cuda.to_device(np.arange(first, first + n, dtype=np.int32))
        paged_cache_write(torch.randn(n, num_kv_heads, HEAD_DIM, device="cuda"),
                          torch.randn(n, num_kv_heads, HEAD_DIM, device="cuda"), k, v, slots, k_scales, v_scales)
    cuda.synchronize()
    words = [splitkv.flat_cache(c, None)[0] for c in (k, v)]
    return num_blocks, words[0], words[1], k_scales.reshape(k_scales.size), v_scales.reshape(v_scales.size)


def split_count(batch: int, num_heads: int, heads: int, blocks: int, ctas_per_sm: int, num_sms: int) -> int:
    """``choose_num_splits``'s rule for a given heads per CTA and CTAs per SM."""
    grid = batch * num_heads // heads
    return int(max(1, min(MAX_SPLITS_PER_HEAD * heads, ctas_per_sm * num_sms // grid, blocks)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--previous-tree", type=Path, help="an older checkout whose combine kernel to time as well")
    args = parser.parse_args(argv)
    import torch
    from numba import cuda

    from fp8lab.numba_kernels import splitkv
    from fp8lab.numba_kernels.kv_cache import placeholder
    from timing import graph_time_us

    previous = previous_splitkv(args.previous_tree) if args.previous_tree else None
    sms = splitkv.device_num_sms()
    rng = np.random.default_rng(0)
    scale_log2 = np.float32(HEAD_DIM**-0.5 * splitkv.LOG2E)
    for num_heads, num_kv_heads in HEAD_SHAPES:
        num_blocks, k_words, v_words, k_scales, v_scales = cache_pool(num_kv_heads, torch, cuda)
        group = num_heads // num_kv_heads
        columns = [(h, c) for h in HEADS if group % h == 0 for c in CTAS_PER_SM]
        print(f"\n#### Decode attention by heads per CTA and CTAs per SM, {num_heads} query / {num_kv_heads} kv heads, "
              f"FP8 cache\n")
        header = ["batch", "context", *(f"H={h}, {c} per SM" for h, c in columns), "fastest", "chosen (auto)"]
        if previous:
            header.append("plan of 2026-12-02, previous combine")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for batch, contexts in CASES:
            for context in contexts:
                blocks = context // BLOCK_SIZE
                tables = [cuda.to_device(rng.choice(num_blocks, batch * blocks, replace=False)
                                         .astype(np.int32).reshape(batch, blocks)) for _ in range(COPIES)]
                q = cuda.to_device(rng.standard_normal((batch, num_heads, HEAD_DIM)).astype(np.float32))
                lens = cuda.to_device(np.full(batch, context, np.int32))
                out = cuda.device_array((batch, num_heads, HEAD_DIM), np.float32)
                workspace = splitkv.decode_workspace(batch, num_heads, HEAD_DIM, 64)
                flat = workspace.reshape(workspace.size)

                def attention(heads, splits, combine):
                    kernel = splitkv._split_kernel("fp8", HEAD_DIM, heads, None)

                    def launch(i, stream):
                        kernel[(batch, num_heads // heads, splits), splitkv.THREADS_PER_CTA, stream](
                            q, k_words, v_words, k_scales, v_scales, tables[i % COPIES], lens, placeholder(1), 0,
                            scale_log2, num_kv_heads, BLOCK_SIZE, splits, workspace, out)
                        if splits > 1:
                            combine(stream, splits)
                    return launch

                def combine(stream, splits):
                    splitkv._combine_kernel[(batch, num_heads), HEAD_DIM, stream](flat, workspace.shape[2], splits, out)

                def run_checked(launch, results, splits):
                    out.copy_to_device(np.full(out.shape, np.nan, np.float32))
                    launch(0, 0)
                    cuda.synchronize()
                    got = out.copy_to_host()
                    if not np.all(np.isfinite(got)):
                        raise RuntimeError(f"batch {batch}, context {context}: non-finite attention output")
                    if splits in results and not np.array_equal(results[splits], got):
                        raise RuntimeError(f"batch {batch}, context {context}: {splits} splits differ by heads per CTA")
                    results[splits] = got

                cells, results = {}, {}
                for heads, ctas_per_sm in columns:
                    splits = split_count(batch, num_heads, heads, blocks, ctas_per_sm, sms)
                    launch = attention(heads, splits, combine)
                    run_checked(launch, results, splits)
                    cells[(heads, ctas_per_sm)] = (graph_time_us(launch, reps=20, replays=9), splits)
                chosen_heads = splitkv.heads_per_cta(group, batch * context)
                chosen_splits = splitkv.choose_num_splits(batch, num_heads, num_kv_heads, context, sms, BLOCK_SIZE)
                chosen = next(key for key, (_, s) in cells.items() if key[0] == chosen_heads and s == chosen_splits)
                fastest = min(cells, key=lambda key: cells[key][0])
                row = [str(batch), str(context), *(f"{cells[key][0]:.1f} ({cells[key][1]})" for key in columns),
                       f"H={fastest[0]}, {fastest[1]} per SM", f"{cells[chosen][0]:.1f} (H={chosen_heads}, {chosen_splits})"]
                if previous:
                    def previous_combine(stream, splits):
                        previous._combine_kernel[(batch, num_heads), HEAD_DIM, stream](workspace, splits, out)
                    old_heads = max(h for h in HEADS if group % h == 0)
                    old_splits = split_count(batch, num_heads, old_heads, blocks, 1, sms)
                    launch = attention(old_heads, old_splits, previous_combine)
                    run_checked(launch, results, old_splits)
                    row.append(f"{graph_time_us(launch, reps=20, replays=9):.1f}")
                print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
