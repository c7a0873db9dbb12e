"""``check_*`` for the FP8 KV cache and attention: KV quantization per (token, kv head), the paged cache
write, paged decode attention. How a check works and reports: ``fp8lab.testing.checks``.

Tolerances (``gamma(n) = n u / (1 - n u)``, ``u = 2^-24``):

- ``quantize_kv``: as the weight quantizer's, with one scale per (token, kv head).
- ``paged_cache_write``: written entries as ``quantize_kv``'s, every other entry untouched (exact).
- ``paged_decode``: ``decode_tolerance``: a float32 score error moves the softmax weights, the
  float32 sums add ``gamma(2 L + 16)``; relative to the largest value the row averages.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import attention, e4m3, kv_cache
from fp8lab.reference import strategies as fst

from . import bugs
from .compare import (
    as_output,
    check_quantized,
    gamma,
    hypothesis_settings,
    matches_pair,
    report_of,
    reproduces,
    same,
    scales_ok,
)
from .report import KernelCheckFailed

# ---------------------------------------------------------------------------- KV quantization and decode attention



def check_kv_quantize(fn, max_examples: int = 40) -> None:
    """``fn(x)`` for float32 ``x[T, kv_heads, head_dim]`` must return ``(codes uint8 like x, scales float32
    [T, kv_heads])``: one scale per (token, kv head), ``amax / 448`` (1 for a zero vector, at least 2^-126),
    within the tolerance of the module docstring."""

    @hypothesis_settings(max_examples)
    @given(st.integers(1, 6), st.integers(1, 4), st.sampled_from([8, 16, 64, 128]), st.integers(0, 2**32 - 1),
           st.booleans())
    def run(t, heads, dim, seed, zero_vector):
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal((t, heads, dim)) * rng.uniform(0.01, 100, (t, heads, 1))).astype(np.float32)
        if zero_vector:
            x[0, 0] = 0
        q, s = (np.asarray(v) for v in fn(x.copy()))
        inputs = {"x": x}
        diagnoses = [b for b in bugs.KV_BUGS if matches_pair(b.mutant(x), q, s)]
        check_quantized("kv quantize", inputs, x, (q, s), kv_cache.quantize_kv(x),
                         lambda scales: np.broadcast_to(scales[..., None], x.shape),
                         "amax / 448 per (token, kv head)", diagnoses)

    run()


def decode_tolerance(data) -> np.ndarray:
    """Per (sequence, query head): ``(2 gamma(D + 8) B + gamma(2 L + 16)) max|v| + 2^-120``, where ``B`` is the
    largest ``|q| . |k_j| * softmax_scale`` of the sequence (a float32 score error of ``gamma(D) B`` changes
    the softmax weights by a relative ``2 gamma(D) B`` at most) and ``L`` its length (the float32 sums)."""
    q = data.q.astype(np.float64)
    num_seqs, num_heads, dim = q.shape
    group = num_heads // data.k_cache.shape[1]
    tol = np.full((num_seqs, num_heads), 2.0**-120)
    for i, length in enumerate(int(n) for n in data.seq_lens):
        if length == 0:
            continue
        k = kv_cache.gather(data.k_cache, data.k_scale, data.block_tables[i], length).astype(np.float64)
        v = kv_cache.gather(data.v_cache, data.v_scale, data.block_tables[i], length).astype(np.float64)
        for h in range(num_heads):
            b = float(np.max(np.abs(k[:, h // group]) @ np.abs(q[i, h]))) * data.softmax_scale
            tol[i, h] += (2 * gamma(dim + 8) * b + gamma(2 * length + 16)) * float(np.max(np.abs(v[:, h // group])))
    return tol


def check_paged_decode(fn, fp8: bool = True, max_examples: int = 30) -> None:
    """``fn(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale)`` must return decode
    attention ``[num_seqs, num_heads, head_dim]`` over fp8lab's paged layout (``fp8lab.reference.kv_cache``:
    caches ``[blocks, kv_heads, block_size, head_dim]``, E4M3 codes with scales when ``fp8``), GQA by
    ``h // (num_heads / num_kv_heads)``, zero rows for length 0, within ``decode_tolerance`` of the oracle."""

    @hypothesis_settings(max_examples)
    @given(fst.paged_kv_layouts(), st.integers(0, 2**32 - 1))
    def run(layout, seed):
        data = layout.random_data(np.random.default_rng(seed), fp8=fp8)
        args = data.decode_args()
        expected = attention.paged_decode(*args)
        actual = as_output("out", fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args)),
                            expected.shape, "paged decode").astype(np.float64)
        tol = decode_tolerance(data)[..., None]
        ok = np.abs(actual - expected) <= tol  # NaN is never within it
        if not ok.all():
            inputs = {"layout": f"{layout.num_heads} query heads over {layout.num_kv_heads} kv heads, head_dim "
                                f"{layout.head_dim}, block_size {layout.block_size}", "seq_lens": data.seq_lens,
                      "block_tables": data.block_tables}
            diagnoses = [b for b in bugs.DECODE_ATTENTION_BUGS if reproduces(b.mutant(*args), actual, tol)]
            raise KernelCheckFailed(report_of("paged decode", inputs, "out", ok, expected, actual,
                                            "(2 gamma(D + 8) B + gamma(2 L + 16)) max|v| per (sequence, head)",
                                            diagnoses))

    run()



# ---------------------------------------------------------------------------- the paged cache write



CACHE_LAYOUTS = {"fp8lab": (0, 1, 2, 3), "vllm": (0, 2, 1, 3)}
"""How a caller's cache axes map to fp8lab's ``[blocks, kv_heads, block_size, head_dim]``: ``"vllm"`` is
``[blocks, block_size, kv_heads, head_dim]`` (scales ``[blocks, block_size, kv_heads]``)."""


def _to_layout(array, layout: str):
    """fp8lab's layout -> the caller's (codes 4-D, scales 3-D); a copy in C order."""
    axes = CACHE_LAYOUTS[layout][: array.ndim]
    return np.array(np.transpose(array, axes), order="C", copy=True)  # never the caller's memory


def _from_layout(array, layout: str):
    axes = CACHE_LAYOUTS[layout][: array.ndim]
    return np.transpose(array, np.argsort(axes))


def check_paged_cache_write(fn, layout: str = "fp8lab", max_examples: int = 40) -> None:
    """``fn(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)`` must write float32 ``k``, ``v``
    ``[T, kv_heads, head_dim]`` into the paged FP8 caches in place: token ``t`` at slot ``slot_mapping[t]``
    (``block * block_size + offset``), quantized per (token, kv head) as ``check_kv_quantize`` requires;
    a slot of -1 is padding and writes nothing; every other cache entry is left as it was (the kit
    poisons it with NaN codes and scales). ``layout``: ``"fp8lab"`` (caches ``[blocks, kv_heads,
    block_size, head_dim]``) or ``"vllm"`` (``[blocks, block_size, kv_heads, head_dim]``)."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(CACHE_LAYOUTS)}, got {layout!r}")

    @hypothesis_settings(max_examples)
    @given(st.integers(1, 6), st.integers(1, 3), st.sampled_from([4, 16, 64]), st.sampled_from([1, 4, 16]),
           st.integers(0, 2**32 - 1), st.booleans())
    def run(t, heads, dim, block_size, seed, padding):
        rng = np.random.default_rng(seed)
        num_blocks = -(-(t + 2) // block_size) + 1
        slots = rng.permutation(num_blocks * block_size)[:t].astype(np.int32)
        if padding:
            slots[rng.integers(0, t)] = -1
        k, v = ((rng.standard_normal((t, heads, dim)) * rng.uniform(0.01, 100, (t, heads, 1))).astype(np.float32)
                for _ in range(2))
        shape = (num_blocks, heads, block_size, dim)
        poisoned = [(np.full(shape, 0x7F, np.uint8), np.full(shape[:3], np.nan, np.float32)) for _ in range(2)]
        expected = [(c.copy(), s.copy()) for c, s in poisoned]
        (ek, eks), (ev, evs) = expected
        kv_cache.write(ek, eks, k[slots >= 0], slots[slots >= 0])
        kv_cache.write(ev, evs, v[slots >= 0], slots[slots >= 0])
        mine = [(_to_layout(c, layout), _to_layout(s, layout)) for c, s in poisoned]
        (mk, mks), (mv, mvs) = mine
        fn(k.copy(), v.copy(), mk, mv, mks, mvs, slots.copy())
        got = [(_from_layout(c, layout), _from_layout(s, layout)) for c, s in mine]
        inputs = {"k": k, "v": v, "slot_mapping": slots, "block_size": block_size, "layout": layout}
        diagnoses = []
        for b in bugs.CACHE_WRITE_BUGS:
            trial = [(c.copy(), s.copy()) for c, s in poisoned]
            b.mutant(k, v, trial[0][0], trial[1][0], trial[0][1], trial[1][1], slots)
            if all(np.all(same(tc, gc)) and np.all(same(ts, gs)) for (tc, ts), (gc, gs) in zip(trial, got)):
                diagnoses.append(b)
        for name, (e_codes, e_scales), (g_codes, g_scales) in zip(("k", "v"), expected, got):
            ok = scales_ok(g_scales, e_scales)
            if not ok.all():
                raise KernelCheckFailed(report_of("paged cache write", inputs, f"{name}_scale", ok, e_scales, g_scales,
                                                "written scales within 1 ulp of amax / 448, the others untouched (NaN)",
                                                diagnoses))
            scales = np.broadcast_to(np.nan_to_num(e_scales, nan=1.0)[..., None], e_codes.shape)
            written = ~np.isnan(e_scales)[..., None] & np.ones(e_codes.shape, bool)
            with np.errstate(invalid="ignore", over="ignore"):
                value, target = e4m3.decode(g_codes).astype(np.float64) * scales, e4m3.decode(e_codes).astype(np.float64) * scales
                # a written code: its value within the half-step of the expected one (both quantize the same x)
                close = np.abs(value - target) <= 2.0**-3 * np.abs(target) + 2.0**-9 * scales
            ok = np.where(written, close & ~e4m3.is_nan(g_codes), g_codes == e_codes)
            if not ok.all():
                raise KernelCheckFailed(report_of("paged cache write", inputs, f"{name}_cache", ok, e_codes, g_codes,
                                                "written codes as the quantizer's, the others untouched (0x7F)",
                                                diagnoses))

    run()
