"""What bounds the tensor-core decode attention's split kernel: its loads, or what it computes between them?

    python3 bench/attention_read_twin.py            # the twin at several depths beside the kernel, four cases
    python3 bench/attention_read_twin.py --blocks   # 16,384 tokens over cache blocks of 16 to 256 tokens

The *read-only twin* is the split kernel without its arithmetic: the same grid (``choose_num_splits``), warps and tile
walk (tiles ``warp, warp + 4, ...`` of a shard, each block from the 32-tile table load and a shuffle), the same loads a
lane issues for a tile (K: 32 bytes of tokens ``g`` and ``g + 8``, two 128-bit loads each; V: 16 bytes of four
tokens; the eight scales), ``depth`` tiles loading while it XORs the words of the one before (the split kernel keeps
2), and nothing else. Its time is the floor this access pattern sets on this GPU; the kernel's time above it is
arithmetic and latency the loads do not hide. Each is timed by CUDA-graph replay (``timing.graph_time_us``) over random
blocks of a 600 MB pool (``attention_plan.cache_pool``), a fresh block draw per replayed launch; the kernel alone,
without the combine. TB/s counts the K/V codes and scales read. One line per row:
``heads | batch | context | splits | what | us | TB/s``.

``--blocks``: the same pool read as blocks of 16 to 256 tokens (the flat cache's row of token ``j`` of block ``b``
and kv head ``h`` is ``(b * kv_heads + h) * block_size + j``, so a larger block is a longer run of one head's rows),
drawn at random, and 16-token blocks in order: does the paging, rather than the loads, set the floor?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, uint32, uint64

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_plan import BLOCK_SIZE, COPIES, HEAD_DIM, cache_pool  # noqa: E402

from fp8lab.numba_kernels.splitkv_mma import THREADS, WARPS, tile_shard_range  # noqa: E402
from fp8lab.numba_kernels.warp import FULL_MASK, WARP_SIZE, load_u32x4  # noqa: E402
from fp8lab.simulators.splitkv_mma import TILE  # noqa: E402

ROW_WORDS = uint64(HEAD_DIM // 4)
KEY_WORDS, VALUE_WORDS, SCALES = 16, 16, 8  # a lane's share of a tile: 2 tokens x 8 words, 4 tokens x 4, 4 x 2
CASES = ((32, 8, 1, 16384), (32, 8, 1, 4096), (32, 8, 8, 2048), (16, 8, 1, 1024))
"""``(query heads, kv heads, batch, context)``."""
DEPTHS = (0, 1, 2, 3)


def read_twin(depth: int):
    """The twin kernel with ``depth`` tiles in flight; arguments as the split kernel's, less the queries and outputs,
    plus ``sink`` (written only if the XOR of every word is one unlikely value: it keeps the loads)."""
    sets = depth + 1
    key_size, value_size, scale_size = sets * KEY_WORDS, sets * VALUE_WORDS, sets * SCALES  # plain constants

    @cuda.jit(device=True, inline=True)
    def load_tile(k_words, v_words, k_scales, v_scales, row0, tile0, end, g, t, slot, kw, vw, sc):
        """The split kernel's loads of one tile (``splitkv_mma.tile_functions``' ``load_tile``) into set ``slot``."""
        for half in range(2):
            if tile0 + 8 * half + g < end:
                first = (row0 + uint64(8 * half + g)) * ROW_WORDS + uint64(8 * t)
                for i in range(2):
                    w0, w1, w2, w3 = load_u32x4(k_words, first + uint64(4 * i))
                    base = slot * KEY_WORDS + half * 8 + 4 * i
                    kw[base], kw[base + 1], kw[base + 2], kw[base + 3] = w0, w1, w2, w3
            else:
                for i in range(8):
                    kw[slot * KEY_WORDS + half * 8 + i] = uint32(0)
        for u in range(4):
            j = 2 * t + (u & 1) + 8 * (u >> 1)
            base = slot * VALUE_WORDS + 4 * u
            if tile0 + j < end:
                row = row0 + uint64(j)
                w0, w1, w2, w3 = load_u32x4(v_words, row * ROW_WORDS + uint64(4 * g))
                vw[base], vw[base + 1], vw[base + 2], vw[base + 3] = w0, w1, w2, w3
                sc[slot * SCALES + 2 * u] = k_scales[row]
                sc[slot * SCALES + 2 * u + 1] = v_scales[row]
            else:
                for i in range(4):
                    vw[base + i] = uint32(0)
                sc[slot * SCALES + 2 * u] = float32(0)
                sc[slot * SCALES + 2 * u + 1] = float32(0)

    @cuda.jit
    def twin(k_words, v_words, k_scales, v_scales, block_tables, seq_lens, num_kv_heads, block_size, num_splits, sink):
        seq, kv, shard = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        g, t = lane >> 2, lane & 3
        start, end = tile_shard_range(seq_lens[seq], shard, num_splits)
        table = block_tables[seq]
        rows_per_block, kv_row = num_kv_heads * block_size, kv * block_size
        tiles = (end - start + TILE - 1) // TILE
        first = start + TILE * lane
        lane_block = table[first // block_size] if first < end else 0
        kw = cuda.local.array(key_size, uint32)
        vw = cuda.local.array(value_size, uint32)
        sc = cuda.local.array(scale_size, float32)
        x = uint32(0)
        f = float32(0)
        for slot in range(depth):  # the first `depth` tiles of the warp
            tile = warp + slot * WARPS
            if tile < tiles:
                block = cuda.shfl_sync(FULL_MASK, lane_block, tile % WARP_SIZE)
                row0 = uint64(block * rows_per_block + kv_row + (start + TILE * tile) % block_size)
                load_tile(k_words, v_words, k_scales, v_scales, row0, start + TILE * tile, end, g, t, slot, kw, vw, sc)
        for tile in range(warp, tiles, WARPS):
            ahead = tile + depth * WARPS
            if ahead < tiles:
                if ahead // WARP_SIZE != (ahead - WARPS) // WARP_SIZE:  # the next 32 tiles' blocks
                    first = start + TILE * (ahead - ahead % WARP_SIZE + lane)
                    lane_block = table[first // block_size] if first < end else 0
                block = cuda.shfl_sync(FULL_MASK, lane_block, ahead % WARP_SIZE)
                row0 = uint64(block * rows_per_block + kv_row + (start + TILE * ahead) % block_size)
                load_tile(k_words, v_words, k_scales, v_scales, row0, start + TILE * ahead, end, g, t, depth, kw, vw,
                          sc)
            for i in range(KEY_WORDS):
                x ^= kw[i]
            for i in range(VALUE_WORDS):
                x ^= vw[i]
            for i in range(SCALES):
                f += sc[i]
            for slot in range(depth):  # the sets move down, as the split kernel's registers do
                for i in range(KEY_WORDS):
                    kw[slot * KEY_WORDS + i] = kw[(slot + 1) * KEY_WORDS + i]
                for i in range(VALUE_WORDS):
                    vw[slot * VALUE_WORDS + i] = vw[(slot + 1) * VALUE_WORDS + i]
                for i in range(SCALES):
                    sc[slot * SCALES + i] = sc[(slot + 1) * SCALES + i]
        if x == uint32(0x9E3779B9) and f == float32(1234.5):
            sink[0] = f

    return twin


def block_tables(rng, pool_blocks: int, batch: int, blocks: int, in_order: bool):
    """``COPIES`` device block tables ``[batch, blocks]``: distinct random blocks, or a random run of blocks in order."""
    if in_order:
        draws = [rng.integers(0, pool_blocks - batch * blocks) + np.arange(batch * blocks) for _ in range(COPIES)]
    else:
        draws = [rng.choice(pool_blocks, batch * blocks, replace=False) for _ in range(COPIES)]
    return [cuda.to_device(d.astype(np.int32).reshape(batch, blocks)) for d in draws]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", action="store_true", help="16,384 tokens over blocks of 16 to 256 tokens")
    args = parser.parse_args(argv)
    import torch
    from timing import graph_time_us

    from fp8lab.numba_kernels import splitkv, splitkv_mma
    from fp8lab.simulators.splitkv_mma import choose_num_splits

    sms = splitkv.device_num_sms()
    scale_log2 = np.float32(HEAD_DIM**-0.5 * splitkv.LOG2E)
    twins = {depth: read_twin(depth) for depth in DEPTHS}
    sink = cuda.device_array(1, np.float32)
    if args.blocks:
        runs = [((32, 8, 1, 16384), size, order == "in order", f"blocks of {size}, {order}")
                for size, order in ((16, "random"), (16, "in order"), (32, "random"), (64, "random"),
                                    (128, "random"), (256, "random"))]
        depths = (2,)
    else:
        runs = [(case, BLOCK_SIZE, False, "") for case in CASES]
        depths = DEPTHS
    pools = {}
    for (num_heads, num_kv_heads, batch, context), block_size, in_order, label in runs:
        if num_kv_heads not in pools:
            torch.manual_seed(num_kv_heads)
            pools[num_kv_heads] = cache_pool(num_kv_heads, torch, cuda)
        num_blocks, k_words, v_words, k_scales, v_scales = pools[num_kv_heads]
        rng = np.random.default_rng(context + block_size)
        tables = block_tables(rng, num_blocks * BLOCK_SIZE // block_size, batch, context // block_size, in_order)
        split = splitkv_mma._split_kernel(HEAD_DIM, num_heads // num_kv_heads, False)
        q = cuda.to_device(rng.standard_normal((batch, num_heads, HEAD_DIM)).astype(np.float32))
        lens = cuda.to_device(np.full(batch, context, np.int32))
        out = cuda.device_array((batch, num_heads, HEAD_DIM), np.float32)
        workspace = splitkv.decode_workspace(batch, num_heads, HEAD_DIM, 64)
        splits = choose_num_splits(batch, num_kv_heads, context, sms)
        grid = (batch, num_kv_heads, splits)
        megabytes = batch * context * num_kv_heads * (2 * HEAD_DIM + 8) / 1e6

        def kernel(i, stream):
            split[grid, THREADS, stream](q, k_words, v_words, k_scales, v_scales, tables[i % COPIES], lens, scale_log2,
                                         num_kv_heads, block_size, splits, workspace, out)

        rows = [("split kernel", graph_time_us(kernel, reps=20, replays=9))]
        for depth in depths:
            def twin(i, stream, twin=twins[depth]):
                twin[grid, THREADS, stream](k_words, v_words, k_scales, v_scales, tables[i % COPIES], lens,
                                            num_kv_heads, block_size, splits, sink)

            rows.append((f"read-only twin, depth {depth}", graph_time_us(twin, reps=20, replays=9)))
        for what, us in rows:
            print(f"{num_heads}/{num_kv_heads} | {batch} | {context} | {splits} | {what}{', ' + label if label else ''}"
                  f" | {us:.2f} | {megabytes / us:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
