"""Where the decode attention time goes: the split kernel and the combine kernel timed apart, by heads per CTA
and tokens in flight (neither changes a result bit; checked here against the default).

    python bench/attention_parts.py

Qwen3-8B heads (32 q / 8 kv, head_dim 128), FP8 and BF16 caches, CUDA-graph replay, K/V rotated past the L2.
Prints one table; a diagnostic for tuning, not a results table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attention import BLOCK_SIZE, HEAD_DIM, L2_BYTES, NUM_HEADS, NUM_KV_HEADS, build_caches  # noqa: E402

CASES = ((1, 1024), (1, 16384), (8, 4096))


def main() -> int:
    import torch
    from numba import cuda

    from fp8lab.numba_kernels import splitkv
    from fp8lab.numba_kernels.kv_cache import placeholder
    from timing import graph_time_us

    print("| batch | context | cache | heads/CTA | U | splits | split kernel us | combine us | whole us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, context in CASES:
        fp8_bytes = 2 * batch * context * NUM_KV_HEADS * (HEAD_DIM + 4)
        copies = max(1, int(np.ceil(3 * L2_BYTES / fp8_bytes)))
        fp8, bf16, tables = build_caches(batch, context, copies, torch, cuda)
        q = cuda.to_device(np.random.default_rng(1).standard_normal((batch, NUM_HEADS, HEAD_DIM)).astype(np.float32))
        lens = cuda.to_device(np.full(batch, context, np.int32))
        tables_dev = [cuda.to_device(tables[c]) for c in range(copies)]
        out = cuda.device_array((batch, NUM_HEADS, HEAD_DIM), np.float32)
        workspace = splitkv.decode_workspace(batch, NUM_HEADS, HEAD_DIM, 64)
        for name, caches in (("fp8", fp8), ("bf16", bf16)):
            scales = (caches[2], caches[3]) if name == "fp8" else (placeholder(1), placeholder(1))
            baseline = None
            for heads, u in ((4, None), (4, 2), (2, None), (1, None)):
                splits = min(splitkv.MAX_SPLITS_PER_HEAD * heads,
                             max(1, 2 * splitkv.device_num_sms() // (batch * NUM_HEADS // heads)), context // BLOCK_SIZE)
                fmt = "fp8" if name == "fp8" else "bf16"
                kernel = splitkv._split_kernel(fmt, HEAD_DIM, heads, u)
                grid = (batch, NUM_HEADS // heads, splits)
                words = [splitkv.flat_cache(c, None)[0] for c in caches[:2]]
                sc = [s.reshape(s.size) if name == "fp8" else s for s in scales]

                def split(i, stream, kernel=kernel, grid=grid, words=words, sc=sc, splits=splits):
                    kernel[grid, splitkv.THREADS_PER_CTA, stream](
                        q, words[0], words[1], sc[0], sc[1], tables_dev[i % copies], lens, placeholder(1), 0,
                        np.float32(HEAD_DIM**-0.5 * splitkv.LOG2E), NUM_KV_HEADS, BLOCK_SIZE, splits, workspace, out)

                def combine(i, stream, splits=splits):
                    splitkv._combine_kernel[(batch, NUM_HEADS), HEAD_DIM, stream](
                        workspace.reshape(workspace.size), workspace.shape[2], splits, out)

                def whole(i, stream, split=split, combine=combine):
                    split(i, stream)
                    combine(i, stream)

                out.copy_to_device(np.full(out.shape, np.nan, np.float32))
                whole(0, 0)
                got = out.copy_to_host()
                assert np.all(np.isfinite(got))
                if baseline is None:
                    baseline = (splits, got)
                elif baseline[0] == splits:
                    assert np.array_equal(got, baseline[1]), (name, heads, u)
                t_split = graph_time_us(split, reps=20)
                t_combine = graph_time_us(combine, reps=20)
                t_whole = graph_time_us(whole, reps=20)
                print(f"| {batch} | {context} | {name} | {heads} | {u or 'default'} | {splits} | {t_split:.1f} "
                      f"| {t_combine:.1f} | {t_whole:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
