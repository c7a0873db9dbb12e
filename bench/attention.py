"""Paged decode attention on the GPU: our FP8 and BF16 caches, split-kv on and off, torch SDPA.

    python bench/attention.py [--out DIR]

Qwen3-8B heads (32 query heads, 8 KV heads, head_dim 128), block size 16, batch 1 and 8, context
1k, 4k and 16k. For each decode configuration it

1. fills paged caches with random K/V through ``fp8lab.numba_kernels.kv_cache.paged_cache_write`` (FP8
   with per (token, kv head) scales, and BF16), with several copies of every sequence's blocks so
   that rotating among them keeps the caches out of the 60 MB L2;
2. validates each variant against ``fp8lab.reference.attention.paged_decode`` (float64, on the host, for
   the first sequence of the batch), output poisoned first;
3. times each variant with CUDA-graph replay, and torch SDPA in BF16 on contiguous K/V
   (``enable_gqa=True``) with CUDA events, both rotating among copies of the K/V past the L2.

Then it sweeps the decode kernel's ``tokens_in_flight`` (same results, different load depth) and
times causal prefill (``fp8lab.numba_kernels.prefill.paged_prefill``: decode of every query token; and
``fp8lab.numba_kernels.prefill_mma.paged_prefill_mma``, the flash prefill on tensor cores over either cache, and
``fp8lab.numba_kernels.prefill_wgmma.paged_prefill_wgmma``, the warpgroup one over the FP8 cache) of
one prompt of 512 and 2048 tokens against SDPA ``is_causal=True``, validated against
``fp8lab.reference.attention.prefill`` first (``--prefill-only``: that table alone).

Writes ``attention_results.md`` and ``attention.png`` into the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = (1, 8)
CONTEXTS = (1024, 4096, 16384)
L2_BYTES = 60e6
SWEEP = {(1, 16384), (8, 4096)}
"""Decode configurations where ``tokens_in_flight`` is swept."""
PREFILL_LENGTHS = (512, 2048)


def build_caches(batch, context, copies, torch, cuda):
    """FP8 and BF16 paged caches holding ``copies`` block sets of ``batch`` sequences of ``context`` tokens."""
    from fp8lab.numba_kernels.kv_cache import paged_cache_write

    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = copies * batch * blocks_per_seq
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    fp8 = [cuda.device_array(shape, np.uint8) for _ in range(2)] + [cuda.device_array(shape[:3], np.float32) for _ in range(2)]
    bf16 = [cuda.device_array(shape, np.uint16) for _ in range(2)]
    perm = np.random.default_rng(context + batch).permutation(num_blocks).astype(np.int32)
    tables = perm.reshape(copies, batch, blocks_per_seq)
    chunk = 8192  # tokens written per call
    for c in range(copies):
        for b in range(batch):
            for start in range(0, context, chunk):
                positions = np.arange(start, min(context, start + chunk))
                slots = tables[c, b, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
                k = torch.randn(len(positions), NUM_KV_HEADS, HEAD_DIM, device="cuda")
                v = torch.randn(len(positions), NUM_KV_HEADS, HEAD_DIM, device="cuda")
                slots_dev = cuda.to_device(slots.astype(np.int32))
                paged_cache_write(k, v, fp8[0], fp8[1], slots_dev, fp8[2], fp8[3])
                paged_cache_write(k, v, bf16[0], bf16[1], slots_dev)
    cuda.synchronize()
    return fp8, bf16, tables


def reference_first_sequence(q, caches, tables, context):
    """``fp8lab.reference.attention.paged_decode`` of sequence 0 (block set 0), float64 on the host."""
    from fp8lab.reference import attention

    k_cache, v_cache = caches[0].copy_to_host(), caches[1].copy_to_host()
    if k_cache.dtype == np.uint16:  # BF16 patterns -> float32
        k_cache = (k_cache.astype(np.uint32) << 16).view(np.float32)
        v_cache = (v_cache.astype(np.uint32) << 16).view(np.float32)
        scales = (None, None)
    else:
        scales = (caches[2].copy_to_host(), caches[3].copy_to_host())
    return attention.paged_decode(q[:1], k_cache, v_cache, tables[0, :1], np.array([context]), HEAD_DIM**-0.5, *scales)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--prefill-only", action="store_true", help="only the causal prefill table")
    args = parser.parse_args(argv)
    import torch
    from numba import cuda

    if args.prefill_only:
        table = "\n".join(prefill_table(torch, cuda)) + "\n"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_prefill_results.md").write_text(table)
        return 0

    from fp8lab.numba_kernels.splitkv import choose_num_splits, decode_workspace, device_num_sms, paged_decode
    from timing import graph_time_us, torch_time_us

    scale = HEAD_DIM**-0.5
    lines = [
        f"### Paged decode attention, {datetime.date.today()}, {torch.cuda.get_device_name()}",
        "",
        f"Command: `python bench/attention.py`. {NUM_HEADS} query / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"block size {BLOCK_SIZE}. Ours: CUDA-graph replay (split kernel + combine kernel), caches rotated past the L2; "
        "SDPA: CUDA events. Error: vs the float64 reference, sequence 0.",
        "",
        "| batch | context | FP8 auto us (splits) | FP8 no split us | BF16 auto us | BF16 no split us | SDPA BF16 us | FP8 / BF16 (auto) | FP8 / SDPA | split speed-up (FP8) | rel. err FP8 / BF16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    results, sweeps = [], []
    for batch in BATCHES:
        for context in CONTEXTS:
            fp8_bytes = 2 * batch * context * NUM_KV_HEADS * (HEAD_DIM + 4)
            copies = max(1, int(np.ceil(3 * L2_BYTES / fp8_bytes)))
            fp8, bf16, tables = build_caches(batch, context, copies, torch, cuda)
            q_host = np.random.default_rng(batch * context).standard_normal((batch, NUM_HEADS, HEAD_DIM)).astype(np.float32)
            q = cuda.to_device(q_host)
            lens = cuda.to_device(np.full(batch, context, np.int32))
            tables_dev = [cuda.to_device(tables[c]) for c in range(copies)]
            out = cuda.device_array((batch, NUM_HEADS, HEAD_DIM), np.float32)
            workspace = decode_workspace(batch, NUM_HEADS, HEAD_DIM)  # allocated before capture
            timings, errors = {}, {}
            for name, caches in (("fp8", fp8), ("bf16", bf16)):
                scales = (caches[2], caches[3]) if name == "fp8" else (None, None)
                ref = reference_first_sequence(q_host, caches, tables, context)
                for splits in ("auto", 1):
                    out.copy_to_device(np.full(out.shape, np.nan, np.float32))
                    paged_decode(q, caches[0], caches[1], tables_dev[0], lens, scale, out, *scales, num_splits=splits,
                                 workspace=workspace, max_seq_len=context)
                    got = out.copy_to_host()
                    assert np.all(np.isfinite(got)), (name, splits)
                    errors[name] = float(np.linalg.norm(got[:1] - ref) / np.linalg.norm(ref))

                    def launch(i, stream, caches=caches, scales=scales, splits=splits):
                        paged_decode(q, caches[0], caches[1], tables_dev[i % copies], lens, scale, out, *scales,
                                     num_splits=splits, workspace=workspace, max_seq_len=context, stream=stream)

                    timings[name, splits] = graph_time_us(launch, reps=20)
            auto_splits = choose_num_splits(batch, NUM_HEADS, NUM_KV_HEADS, context, device_num_sms())
            if (batch, context) in SWEEP:
                sweeps.append(sweep_tokens_in_flight(batch, context, q, fp8, bf16, tables_dev, lens, out, workspace))
            q_t = torch.from_numpy(q_host).to("cuda", torch.bfloat16)[:, :, None, :]
            sdpa_copies = max(1, int(np.ceil(3 * L2_BYTES / (fp8_bytes * 2))))
            kv_t = [(torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                     torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
                    for _ in range(sdpa_copies)]
            sdpa = torch_time_us(lambda i: torch.nn.functional.scaled_dot_product_attention(
                q_t, *kv_t[i % sdpa_copies], enable_gqa=True))
            row = (batch, context, timings["fp8", "auto"], auto_splits, timings["fp8", 1], timings["bf16", "auto"],
                   timings["bf16", 1], sdpa)
            results.append(row)
            lines.append(
                f"| {batch} | {context} | {row[2]:.1f} ({auto_splits}) | {row[4]:.1f} | {row[5]:.1f} | {row[6]:.1f} | {sdpa:.1f} "
                f"| {row[2] / row[5]:.2f} | {row[2] / sdpa:.2f} | {row[4] / row[2]:.2f}x | {errors['fp8']:.1e} / {errors['bf16']:.1e} |"
            )
            print(lines[-1], flush=True)

    lines += sweep_table(sweeps)
    lines += prefill_table(torch, cuda)
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_results.md").write_text(table)
    plot(results, args.out / "attention.png")
    print(table)
    return 0


def sweep_tokens_in_flight(batch, context, q, fp8, bf16, tables_dev, lens, out, workspace):
    """Decode time (auto splits) for each ``tokens_in_flight`` (loads in flight per slot; the results are
    the same bits, which is checked here against the default)."""
    from fp8lab.numba_kernels.splitkv import paged_decode
    from timing import graph_time_us

    row = {"batch": batch, "context": context}
    copies = len(tables_dev)
    for name, caches, choices in (("fp8", fp8, (1, 2, 4, 8)), ("bf16", bf16, (1, 2, 4))):
        scales = (caches[2], caches[3]) if name == "fp8" else (None, None)
        baseline = None
        for u in choices:
            out.copy_to_device(np.full(out.shape, np.nan, np.float32))
            paged_decode(q, caches[0], caches[1], tables_dev[0], lens, HEAD_DIM**-0.5, out, *scales, workspace=workspace,
                         max_seq_len=context, tokens_in_flight=u)
            got = out.copy_to_host()
            baseline = got if baseline is None else baseline
            assert np.array_equal(got, baseline), (name, u)  # the load depth never changes a bit

            def launch(i, stream, caches=caches, scales=scales, u=u):
                paged_decode(q, caches[0], caches[1], tables_dev[i % copies], lens, HEAD_DIM**-0.5, out, *scales,
                             workspace=workspace, max_seq_len=context, stream=stream, tokens_in_flight=u)

            row[name, u] = graph_time_us(launch, reps=20)
    print(row, flush=True)
    return row


def sweep_table(sweeps):
    lines = ["", "Decode, auto splits, by `tokens_in_flight` (tokens a slot loads before computing; same bits):", "",
             "| batch | context | FP8 U=1 | U=2 | U=4 | U=8 | BF16 U=1 | U=2 | U=4 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sweeps:
        cells = [f"{r['fp8', u]:.1f}" for u in (1, 2, 4, 8)] + [f"{r['bf16', u]:.1f}" for u in (1, 2, 4)]
        lines.append(f"| {r['batch']} | {r['context']} | " + " | ".join(cells) + " |")
    return lines


def prefill_table(torch, cuda):
    """Causal prefill of one prompt, FP8 and BF16 caches, against SDPA BF16 ``is_causal=True`` (contiguous)."""
    from fp8lab.numba_kernels.kv_cache import paged_cache_write
    from fp8lab.numba_kernels.prefill import paged_prefill, prefill_rows_workspace
    from fp8lab.numba_kernels.prefill_mma import paged_prefill_mma
    from fp8lab.numba_kernels.prefill_wgmma import paged_prefill_wgmma
    from fp8lab.numba_kernels.splitkv import decode_workspace
    from fp8lab.reference import attention, kv_cache
    from timing import graph_time_us, torch_time_us

    lines = ["", "Causal prefill of one prompt (SIMT: decode of every query token over its prefix, one graph "
             "replay = expansion + split kernel (+ combine); tensor cores: the flash prefill, `prefill_mma`, one "
             "launch, what the engine runs; warpgroup: `prefill_wgmma`, each FP8 code decoded once per CTA of one or two "
             "warpgroups, bits compared with `prefill_mma`'s):", "",
             "| prompt | FP8 SIMT us | FP8 tensor cores us | FP8 warpgroup us (1 / 2 a CTA) | BF16 SIMT us "
             "| BF16 tensor cores us | SDPA BF16 causal us | FP8 tensor cores / SDPA | FP8 warpgroup / SDPA (1 / 2) "
             "| BF16 tensor cores / SDPA | rel. err FP8 SIMT / TC / warpgroup (1 / 2), BF16 SIMT / TC "
             "| warpgroup bits = TC bits (1 / 2) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    scale = HEAD_DIM**-0.5
    for length in PREFILL_LENGTHS:
        rng = np.random.default_rng(length)
        blocks = length // BLOCK_SIZE
        table = rng.permutation(blocks).astype(np.int32)[None, :]
        shape = (blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
        k = rng.standard_normal((length, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((length, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
        q = rng.standard_normal((length, NUM_HEADS, HEAD_DIM)).astype(np.float32)
        slots = cuda.to_device(kv_cache.slots_for_positions(table[0], np.arange(length), BLOCK_SIZE).astype(np.int32))
        caches = {"fp8": [cuda.device_array(shape, np.uint8) for _ in range(2)] + [cuda.device_array(shape[:3], np.float32) for _ in range(2)],
                  "bf16": [cuda.device_array(shape, np.uint16) for _ in range(2)] + [None, None]}
        k_dev, v_dev, q_dev = cuda.to_device(k), cuda.to_device(v), cuda.to_device(q)
        lens_dev = cuda.to_device(np.array([length], np.int32))
        table_dev = cuda.to_device(table)
        rows = prefill_rows_workspace(length, blocks)
        workspace = decode_workspace(length, NUM_HEADS, HEAD_DIM)
        out = cuda.device_array(q.shape, np.float32)
        times, errors, same_bits = {}, {}, {}
        for name, c in caches.items():
            paged_cache_write(k_dev, v_dev, c[0], c[1], slots, c[2], c[3])
            host = [x.copy_to_host() if x is not None else None for x in c]
            if name == "bf16":
                host[0], host[1] = ((x.astype(np.uint32) << 16).view(np.float32) for x in host[:2])
            k_ref = kv_cache.gather(host[0], host[2], table[0], length)
            v_ref = kv_cache.gather(host[1], host[3], table[0], length)
            checked = min(length, 256)  # the reference (float64, per query) for the last 256 queries only
            ref = attention.prefill(q[-checked:], k_ref, v_ref, scale)
            out.copy_to_device(np.full(q.shape, np.nan, np.float32))
            paged_prefill(q_dev, c[0], c[1], table_dev, lens_dev, lens_dev, scale, out, c[2], c[3],
                          max_context_len=length, rows=rows, workspace=workspace)
            got = out.copy_to_host()
            assert np.all(np.isfinite(got)), name
            errors[name] = float(np.linalg.norm(got[-checked:] - ref) / np.linalg.norm(ref))
            # the flash prefill on tensor cores, same cache
            out.copy_to_device(np.full(q.shape, np.nan, np.float32))
            paged_prefill_mma(q_dev, c[0], c[1], table_dev, lens_dev, lens_dev, scale, out, c[2], c[3],
                              max_context_len=length)
            got = out.copy_to_host()
            assert np.all(np.isfinite(got)), f"{name} tensor cores"
            errors[name, "mma"] = float(np.linalg.norm(got[-checked:] - ref) / np.linalg.norm(ref))
            times[name, "mma"] = graph_time_us(lambda i, stream, c=c: paged_prefill_mma(
                q_dev, c[0], c[1], table_dev, lens_dev, lens_dev, scale, out, c[2], c[3], max_context_len=length,
                stream=stream), reps=5, replays=7)
            tensor_core_out = got
            for warpgroups in (1, 2) if name == "fp8" else ():  # the warpgroup flash prefill, same cache
                out.copy_to_device(np.full(q.shape, np.nan, np.float32))
                paged_prefill_wgmma(q_dev, c[0], c[1], table_dev, lens_dev, lens_dev, scale, out, c[2], c[3],
                                    max_context_len=length, warpgroups=warpgroups)
                got = out.copy_to_host()
                assert np.all(np.isfinite(got)), f"fp8 warpgroup x{warpgroups}"
                errors["wgmma", warpgroups] = float(np.linalg.norm(got[-checked:] - ref) / np.linalg.norm(ref))
                same_bits[warpgroups] = np.array_equal(got.view(np.uint32), tensor_core_out.view(np.uint32))
                times["wgmma", warpgroups] = graph_time_us(lambda i, stream, c=c, w=warpgroups: paged_prefill_wgmma(
                    q_dev, c[0], c[1], table_dev, lens_dev, lens_dev, scale, out, c[2], c[3], max_context_len=length,
                    warpgroups=w, stream=stream), reps=5, replays=7)

            def launch(i, stream, c=c):
                paged_prefill(q_dev, c[0], c[1], table_dev, lens_dev, lens_dev, scale, out, c[2], c[3],
                              max_context_len=length, rows=rows, workspace=workspace, stream=stream)

            times[name] = graph_time_us(launch, reps=5, replays=7)
        q_t = torch.from_numpy(q).to("cuda", torch.bfloat16).transpose(0, 1)[None]
        k_t = torch.from_numpy(k).to("cuda", torch.bfloat16).transpose(0, 1)[None]
        v_t = torch.from_numpy(v).to("cuda", torch.bfloat16).transpose(0, 1)[None]
        sdpa = torch_time_us(lambda i: torch.nn.functional.scaled_dot_product_attention(
            q_t, k_t, v_t, is_causal=True, enable_gqa=True), iters=20)
        lines.append(f"| {length} | {times['fp8']:.1f} | {times['fp8', 'mma']:.1f} "
                     f"| {times['wgmma', 1]:.1f} / {times['wgmma', 2]:.1f} | {times['bf16']:.1f} "
                     f"| {times['bf16', 'mma']:.1f} | {sdpa:.1f} | {times['fp8', 'mma'] / sdpa:.2f} "
                     f"| {times['wgmma', 1] / sdpa:.2f} / {times['wgmma', 2] / sdpa:.2f} "
                     f"| {times['bf16', 'mma'] / sdpa:.2f} | {errors['fp8']:.1e} / {errors['fp8', 'mma']:.1e} / "
                     f"{errors['wgmma', 1]:.1e} / {errors['wgmma', 2]:.1e}, {errors['bf16']:.1e} / "
                     f"{errors['bf16', 'mma']:.1e} | {same_bits[1]} / {same_bits[2]} |")
        print(lines[-1], flush=True)
    return lines


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"B={b}\nL={c // 1024}k" for b, c, *_ in results]
    series = {"FP8 cache, split auto": 2, "FP8 cache, no split": 4, "BF16 cache, split auto": 5,
              "BF16 cache, no split": 6, "torch SDPA BF16 (contiguous)": 7}
    x = np.arange(len(results))
    width = 0.16
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, (name, column) in enumerate(series.items()):
        ax.bar(x + (i - 2) * width, [r[column] for r in results], width, label=name)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds per decode step (one layer)")
    ax.set_title("Paged decode attention, Qwen3-8B heads (32 q / 8 kv, head_dim 128)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
