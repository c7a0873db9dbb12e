"""The tensor-core decode attention at its ``"auto"`` split count, timed, with a hash of each output: an A/B of a
change that must keep the bits, run in two trees on one GPU.

    python3 bench/attention_mma_ab.py LABEL [--quick]                 # in this tree
    (cd BASELINE && PYTHONPATH=$PWD python3 /path/to/bench/attention_mma_ab.py base)   # then in the baseline's

For the Qwen3-8B heads (32 query, 8 kv) and the Qwen3-0.6B heads (16 query, 8 kv), head_dim 128, block size 16: one
split kernel and the combine per call, timed by CUDA-graph replay (``timing.graph_time_us``) over random blocks of a
600 MB pool of random K/V (``attention_plan.cache_pool``, a fresh block draw per replayed launch). Every run draws
the same data (seeded), so two trees that compute the same bits print the same hashes; a row whose output is not
finite says so. One line per case: ``LABEL | heads | batch | context | splits | us | finite | hash``. ``--quick``:
the 8B heads at 1,024, 4,096, 16,384 tokens and batch 8 over 2,048 only. ``--wider``: each case also at 1.5 times the
``"auto"`` count (a third CTA per SM where the rule fills two), a second line. ``--sdpa``: after each batch-1 case,
torch's BF16 ``scaled_dot_product_attention`` over the same shape (``attention_mma.sdpa_time_us``) and our time over
it, issue 16's "no slower than SDPA at 16k" in the same run: ``LABEL | heads | 1 | context | sdpa | us | ratio``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_plan import BLOCK_SIZE, COPIES, HEAD_DIM, cache_pool  # noqa: E402

CASES = ((1, 512), (1, 1024), (1, 4096), (1, 16384), (4, 512), (8, 2048), (16, 512))
QUICK_CASES = ((1, 1024), (1, 4096), (1, 16384), (8, 2048))
HEAD_SHAPES = ((32, 8), (16, 8))


def timed(kernel, q, cache, tables, lens, scale_log2, num_kv_heads, splits, workspace, out):
    """``(us, "finite" or "NOT FINITE", hash)`` of the split kernel and the combine at ``splits`` shards over ``cache``
    (``k_words, v_words, k_scales, v_scales``): the output (NaN-poisoned first) of one launch over ``tables[0]``, then
    the graph-replayed time over all the tables."""
    from numba import cuda
    from timing import graph_time_us

    from fp8lab.numba_kernels import splitkv, splitkv_mma

    batch = q.shape[0]
    flat = workspace.reshape(workspace.size)

    def launch(i, stream):
        kernel[(batch, num_kv_heads, splits), splitkv_mma.THREADS, stream](
            q, *cache, tables[i % COPIES], lens, scale_log2, num_kv_heads, BLOCK_SIZE, splits, workspace, out)
        if splits > 1:
            splitkv._combine_kernel[(batch, q.shape[1]), HEAD_DIM, stream](flat, workspace.shape[2], splits, out)

    out.copy_to_device(np.full(out.shape, np.nan, np.float32))  # poisoned: a row the kernel skips shows
    launch(0, 0)
    cuda.synchronize()
    got = out.copy_to_host()
    digest = hashlib.sha1(got.tobytes()).hexdigest()[:12]
    us = graph_time_us(launch, reps=20, replays=9)
    return us, "finite" if np.all(np.isfinite(got)) else "NOT FINITE", digest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("label")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--wider", action="store_true")
    parser.add_argument("--sdpa", action="store_true")
    args = parser.parse_args(argv)
    import torch
    from numba import cuda

    # the tree first on the path: this one, or the baseline's
    from fp8lab.numba_kernels import splitkv, splitkv_mma
    from fp8lab.simulators import splitkv_mma as plan

    sms = splitkv.device_num_sms()
    scale_log2 = np.float32(HEAD_DIM**-0.5 * splitkv.LOG2E)
    for num_heads, num_kv_heads in HEAD_SHAPES[: 1 if args.quick else 2]:
        rng = np.random.default_rng(num_heads)
        torch.manual_seed(num_heads)
        num_blocks, k_words, v_words, k_scales, v_scales = cache_pool(num_kv_heads, torch, cuda)
        kernel = splitkv_mma._split_kernel(HEAD_DIM, num_heads // num_kv_heads, False)
        for batch, context in QUICK_CASES if args.quick else CASES:
            blocks = context // BLOCK_SIZE
            tables = [cuda.to_device(rng.choice(num_blocks, batch * blocks, replace=False)
                                     .astype(np.int32).reshape(batch, blocks)) for _ in range(COPIES)]
            q = cuda.to_device(rng.standard_normal((batch, num_heads, HEAD_DIM)).astype(np.float32))
            lens_host = np.full(batch, context, np.int32)
            lens_host[1:] = rng.integers(context // 2, context + 1, batch - 1)  # a batch's rows of several lengths
            lens = cuda.to_device(lens_host)
            out = cuda.device_array((batch, num_heads, HEAD_DIM), np.float32)
            workspace = splitkv.decode_workspace(batch, num_heads, HEAD_DIM, 64)
            auto = plan.choose_num_splits(batch, num_kv_heads, context, sms)
            for splits in sorted({auto, auto * 3 // 2 if args.wider else auto}):
                us, finite, digest = timed(kernel, q, (k_words, v_words, k_scales, v_scales), tables, lens, scale_log2,
                                           num_kv_heads, splits, workspace, out)
                print(f"{args.label} | {num_heads}/{num_kv_heads} | {batch} | {context} | {splits} | {us:.2f} | "
                      f"{finite} | {digest}", flush=True)
            if args.sdpa and batch == 1:
                from attention_mma import sdpa_time_us

                sdpa_us = sdpa_time_us(torch, num_heads, num_kv_heads, context)
                print(f"{args.label} | {num_heads}/{num_kv_heads} | 1 | {context} | sdpa | {sdpa_us:.2f} | "
                      f"ours / sdpa {us / sdpa_us:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
