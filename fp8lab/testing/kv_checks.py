"""``check_*`` for the FP8 KV cache and attention: KV quantization per (token, kv head), the paged cache
write, paged decode attention (fp8lab's or vLLM's cache layout, ALiBi) and causal prefill (chunked,
ALiBi). How a check works and reports: ``fp8lab.testing.checks``.

Tolerances (``gamma(n) = n u / (1 - n u)``, ``u = 2^-24``):

- ``quantize_kv``: as the weight quantizer's, with one scale per (token, kv head).
- ``paged_cache_write``: written entries as ``quantize_kv``'s, every other entry untouched (exact).
- ``paged_decode`` and ``prefill``: ``attention_tolerance``, per (row, query head): a float32 score error
  (the dot product and the ALiBi term) moves the softmax weights, the float32 sums over the ``L`` keys add
  ``gamma(2 L + 16)``; relative to the largest value the row averages. A decode kernel on tensor cores states
  the format it rounds its operands to (``operands="f16"`` or ``"bf16"``), and the bound adds what that costs.
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
    consistent_classes,
    gamma,
    hypothesis_settings,
    quantized_alike,
    report_of,
    reproduces,
    same,
    scales_ok,
)
from .report import KernelCheckFailed

# ---------------------------------------------------------------------------- cache layouts


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
        diagnoses = consistent_classes(bugs.KV_BUGS, lambda b: quantized_alike(b.mutant(x), q, s))
        check_quantized("kv quantize", inputs, x, (q, s), kv_cache.quantize_kv(x),
                         lambda scales: np.broadcast_to(scales[..., None], x.shape),
                         "amax / 448 per (token, kv head)", diagnoses)

    run()


OPERANDS = {"f32": (0.0, 0.0), "f16": (2.0**-11, 2.0**-25), "bf16": (2.0**-8, 0.0)}
"""The formats a kernel may round its attention operands to (``operands=``): ``(u, s)``, the unit roundoff and the
largest absolute rounding error of a weight in ``[0, 2]`` that underflows (F16's subnormals: half of ``2^-24``;
BF16 reaches ``2^-126``). ``"f32"``: nothing is rounded below float32."""


def attention_tolerance(q, k, v, softmax_scale: float, positions, alibi_slopes=None, operands: str = "f32") -> np.ndarray:
    """The float32 bound of causal softmax attention, per (query row, query head): float64 ``[R, num_heads]``.

    Query row ``r`` of ``q[R, num_heads, D]`` sits at position ``p = positions[r]`` and reads keys ``0 .. p`` of
    ``k, v[S, num_kv_heads, D]`` (the values the oracle reads, dequantized), GQA by ``h // (num_heads /
    num_kv_heads)``. The bound is ``(2 gamma(D + 8) B + gamma(2 L + 16)) max|v_j| + 2^-120`` with ``L = p + 1``
    keys and ``B = max_j |q_h| . |k_j| * softmax_scale + |slope_h| (p - j)`` over the keys read: a float32
    score (dot product, ALiBi term, log2-domain scaling) is off by at most ``gamma(D + 8) B``, which moves
    every softmax weight by a relative ``2 gamma(D + 8) B`` at most; the float32 sums over the ``L`` keys
    (``l``, ``acc``, and the exp2 of a kernel) add ``gamma(2 L + 16)`` of the largest value averaged.

    ``operands`` (``OPERANDS``): a tensor-core kernel that rounds the query and keys, the softmax weights and the
    values to ``"f16"`` or ``"bf16"`` (unit roundoff ``u``) gets ``(expm1(2 (2 u + u^2) B) + 3 u + L s) max|v_j|``
    more: the rounded query and key move a score by ``(2 u + u^2) B`` at most, hence a weight by ``expm1`` of
    twice that; the weight (with any scale folded into it), the value and their product's scale add ``u`` each,
    relative to the row's average; an underflowing weight is off by ``s`` at most (weights up to 2, relative to a
    scale the kernel folds in), ``L s`` of the largest value in all."""
    if operands not in OPERANDS:
        raise ValueError(f"operands: expected one of {', '.join(OPERANDS)}, got {operands!r}")
    u, s = OPERANDS[operands]
    q64, k64, v64 = (np.abs(np.asarray(x, np.float64)) for x in (q, k, v))
    num_heads, dim, num_keys = q64.shape[1], q64.shape[2], k64.shape[0]
    kv_head = np.arange(num_heads) // (num_heads // k64.shape[1])
    pos = np.asarray(positions, np.int64)
    behind = pos[:, None] - np.arange(num_keys)[None, :]  # [R, S]: p - j, >= 0 for the keys row r reads
    bound = np.einsum("rhd,shd->rhs", q64, k64[:, kv_head]) * abs(float(softmax_scale))
    if alibi_slopes is not None:
        bound = bound + np.abs(np.asarray(alibi_slopes, np.float64))[None, :, None] * behind[:, None, :]
    b = np.max(np.where((behind >= 0)[:, None, :], bound, 0.0), axis=2)
    v_max = np.maximum.accumulate(np.max(v64, axis=2), axis=0)[pos][:, kv_head]  # over the keys 0 .. p
    keys = pos[:, None] + 1
    rounded = np.expm1(2 * (2 * u + u * u) * b) + 3 * u + keys * s
    return (2 * gamma(dim + 8) * b + gamma(2 * keys + 16) + rounded) * v_max + 2.0**-120


ATTENTION_TOLERANCE = ("(2 gamma(D + 8) B + gamma(2 L + 16)) max|v| + 2^-120 per (row, head), "
                       "B = max_j |q|.|k_j| scale + |slope| (p - j)")


def tolerance_text(operands: str) -> str:
    """``ATTENTION_TOLERANCE``, with what the operands' roundings add (a report's words)."""
    if operands == "f32":
        return ATTENTION_TOLERANCE
    return ATTENTION_TOLERANCE + f"; {operands} operands add (expm1(2 (2u + u^2) B) + 3u + L s) max|v|"


def decode_tolerance(data, alibi_slopes=None, operands: str = "f32") -> np.ndarray:
    """``attention_tolerance`` of every (sequence, query head) of ``data`` (a ``PagedKVData``): the query of a
    sequence of length ``L`` sits at position ``L - 1``; a sequence of length 0 (a zero row) gets ``2^-120``."""
    tol = np.full(data.q.shape[:2], 2.0**-120)
    for i, length in enumerate(int(n) for n in data.seq_lens):
        if length:
            k = kv_cache.gather(data.k_cache, data.k_scale, data.block_tables[i], length)
            v = kv_cache.gather(data.v_cache, data.v_scale, data.block_tables[i], length)
            tol[i] = attention_tolerance(data.q[i][None], k, v, data.softmax_scale, [length - 1], alibi_slopes,
                                         operands)[0]
    return tol


def _random_slopes(rng: np.random.Generator, num_heads: int) -> np.ndarray:
    """ALiBi slopes as models use them (``2^-8h/H``, positive and at most 1), drawn at random: float32
    ``2^-u``, ``u`` uniform in [0, 8], per query head."""
    return (2.0 ** -rng.uniform(0, 8, num_heads)).astype(np.float32)


def _diagnose(candidates, args: tuple, keywords: dict, actual: np.ndarray, tol: np.ndarray) -> list:
    """The bug classes among ``candidates`` whose mutant, run on ``args`` and ``keywords``, reproduces
    ``actual`` within ``tol``; each name once (a class written as several mutants, such as one per shard
    count, is named by the first that reproduces it, whose summary then says which)."""
    return consistent_classes(candidates, lambda b: reproduces(b.mutant(*args, **keywords), actual, tol))


def _caches_in_layout(args: tuple, layout: str) -> tuple:
    """``paged_decode``'s arguments with the caches (1, 2) and their scales (6, 7) in ``layout``; every array
    a fresh copy, so the callable never sees the kit's own."""
    return tuple(_to_layout(a, layout) if i in (1, 2, 6, 7) and a is not None
                 else a.copy() if isinstance(a, np.ndarray) else a for i, a in enumerate(args))


HEAD_DIMS = (4, 8, 16, 64)
"""The head sizes the attention checks draw unless told otherwise: small ones shrink well, 64 is a real one."""


def _positive_sizes(name: str, sizes, what: str, example: str) -> tuple[int, ...]:
    """``sizes`` as a tuple of positive ints, or a ``ValueError`` naming the option ``name`` and ``what`` it holds."""
    try:
        checked = tuple(int(x) for x in sizes)
    except (TypeError, ValueError):
        checked = ()
    if not checked or min(checked) < 1:
        raise ValueError(f"{name}: expected positive {what}, e.g. {example}, got {sizes!r}")
    return checked


BLOCK_SIZES = (1, 2, 4, 8, 16)
"""The block sizes ``check_paged_decode`` draws unless told others."""


def check_paged_decode(fn, fp8: bool = True, alibi: bool = False, layout: str = "fp8lab",
                       head_dims=HEAD_DIMS, max_examples: int = 30, operands: str = "f32",
                       block_sizes=BLOCK_SIZES) -> None:
    """``fn(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale)`` (with ``alibi``, also
    ``alibi_slopes=`` float32 ``[num_heads]`` as a keyword) must return decode attention ``[num_seqs, num_heads,
    head_dim]``: the query of a sequence of length ``L`` at position ``L - 1``, ALiBi bias ``slope_h * (j - (L -
    1))``, GQA by ``h // (num_heads / num_kv_heads)``, zero rows for length 0, within ``attention_tolerance``
    of the oracle. ``layout``: ``"fp8lab"`` (caches ``[blocks, kv_heads, block_size, head_dim]``, scales
    ``[blocks, kv_heads, block_size]``) or ``"vllm"`` (``[blocks, block_size, kv_heads, head_dim]``, scales
    ``[blocks, block_size, kv_heads]``); E4M3 codes with float32 scales when ``fp8``, float32 and scales None
    otherwise. Slots past a sequence's length (and unused blocks) hold NaN (NaN codes and NaN scales), in
    either layout: a kernel that reads one shows it. ``head_dims``: the head sizes drawn (a kernel that
    supports only some passes those); ``block_sizes``: the block sizes drawn (``BLOCK_SIZES``).
    ``operands``: ``"f16"`` or ``"bf16"`` for a tensor-core kernel that rounds its query, keys, softmax weights and
    values to that format (``attention_tolerance`` then adds what those roundings cost); ``"f32"`` otherwise."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(CACHE_LAYOUTS)}, got {layout!r}")
    if operands not in OPERANDS:
        raise ValueError(f"operands: expected one of {', '.join(OPERANDS)}, got {operands!r}")
    head_dims = _positive_sizes("head_dims", head_dims, "head sizes", "(64, 128)")
    layouts = fst.paged_kv_layouts(head_dims=head_dims, block_sizes=_positive_sizes("block_sizes", block_sizes, "block sizes", "(16, 32)"))
    candidates = bugs.DECODE_ATTENTION_BUGS + (bugs.ALIBI_DECODE_BUGS if alibi else [])

    @hypothesis_settings(max_examples)
    @given(layouts, st.integers(0, 2**32 - 1))
    def run(paged, seed):
        rng = np.random.default_rng(seed)
        data = paged.random_data(rng, fp8=fp8)
        args = data.decode_args()
        slopes = {"alibi_slopes": _random_slopes(rng, paged.num_heads)} if alibi else {}
        expected = attention.paged_decode(*args, **slopes)
        got = fn(*_caches_in_layout(args, layout), **{name: a.copy() for name, a in slopes.items()})
        actual = as_output("out", got, expected.shape, "paged decode").astype(np.float64)
        tol = decode_tolerance(data, slopes.get("alibi_slopes"), operands)[..., None]
        ok = np.abs(actual - expected) <= tol  # NaN is never within it
        if not ok.all():
            inputs = {"layout": f"{paged.num_heads} query heads over {paged.num_kv_heads} kv heads, head_dim "
                                f"{paged.head_dim}, block_size {paged.block_size}, {layout}'s cache layout",
                      "seq_lens": data.seq_lens, "block_tables": data.block_tables, **slopes}
            diagnoses = _diagnose(candidates, args, slopes, actual, tol)
            raise KernelCheckFailed(report_of("paged decode", inputs, "out", ok, expected, actual,
                                              tolerance_text(operands), diagnoses))

    run()


# ---------------------------------------------------------------------------- causal prefill


def check_prefill(fn, fp8: bool = True, alibi: bool = False, head_dims=HEAD_DIMS, max_examples: int = 30,
                  operands: str = "f32") -> None:
    """``fn(q, k, v, softmax_scale, k_scale, v_scale)`` (with ``alibi``, also ``alibi_slopes=`` float32
    ``[num_heads]`` as a keyword) must return causal attention ``[T, num_heads, head_dim]`` of ``T`` new tokens,
    ``q[T, num_heads, head_dim]``, over ``S >= T`` keys ``k, v[S, num_kv_heads, head_dim]`` whose first ``S - T``
    are an earlier prefix (chunked prefill; ``S = T`` too): query ``i`` sits at position ``p = S - T + i`` and
    attends keys ``0 .. p`` with ALiBi bias ``slope_h * (j - p)``, GQA by ``h // (num_heads / num_kv_heads)``,
    within ``attention_tolerance`` of ``fp8lab.reference.attention.prefill``. With ``fp8``, ``k`` and ``v`` are
    E4M3 codes (uint8) with float32 scales ``[S, num_kv_heads]`` (``kv_cache.quantize_kv``: the value is
    ``decode(code) * scale``); otherwise float32 with ``k_scale = v_scale = None``.

    K and V are finite: every key is read by the last query, so prefill has no never-read slot to poison,
    and a kernel that reads a key after a query's position is caught by value (that key changes the row by
    far more than the tolerance). A NaN key would test a kernel's NaN hygiene instead (a tiled kernel's
    masked ``0 * NaN`` in ``P @ V``), which no real prompt asks of it. ``head_dims``: the head sizes drawn.
    ``operands``: as ``check_paged_decode``'s (``"f16"`` or ``"bf16"`` for a tensor-core kernel)."""
    if operands not in OPERANDS:
        raise ValueError(f"operands: expected one of {', '.join(OPERANDS)}, got {operands!r}")
    head_dims = _positive_sizes("head_dims", head_dims, "head sizes", "(64, 128)")
    candidates = bugs.PREFILL_BUGS + (bugs.ALIBI_PREFILL_BUGS if alibi else [])

    @hypothesis_settings(max_examples)
    @given(st.integers(1, 12), st.one_of(st.just(0), st.integers(1, 10)), st.integers(1, 3), st.sampled_from([1, 2, 4]),
           st.sampled_from(head_dims), st.integers(0, 2**32 - 1))
    def run(t, prefix, kv_heads, group, dim, seed):
        rng = np.random.default_rng(seed)
        s, heads = prefix + t, kv_heads * group
        q = rng.standard_normal((t, heads, dim)).astype(np.float32)
        k, v = ((rng.standard_normal((s, kv_heads, dim)) * rng.uniform(0.1, 4.0, (s, kv_heads, 1))).astype(np.float32)
                for _ in range(2))
        if fp8:
            (k, k_scale), (v, v_scale) = kv_cache.quantize_kv(k), kv_cache.quantize_kv(v)
            k_dense, v_dense = kv_cache.dequantize_kv(k, k_scale), kv_cache.dequantize_kv(v, v_scale)
        else:
            k_scale = v_scale = None
            k_dense, v_dense = k, v
        softmax_scale = float(dim) ** -0.5
        args = (q, k, v, softmax_scale, k_scale, v_scale)
        slopes = {"alibi_slopes": _random_slopes(rng, heads)} if alibi else {}
        expected = attention.prefill(q, k_dense, v_dense, softmax_scale, **slopes)
        got = fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args),
                 **{name: a.copy() for name, a in slopes.items()})
        actual = as_output("out", got, expected.shape, "prefill").astype(np.float64)
        tol = attention_tolerance(q, k_dense, v_dense, softmax_scale, prefix + np.arange(t),
                                  slopes.get("alibi_slopes"), operands)[..., None]
        ok = np.abs(actual - expected) <= tol  # NaN is never within it
        if not ok.all():
            inputs = {"shape": f"T = {t} new tokens over S = {s} keys (a prefix of {prefix}), {heads} query heads "
                               f"over {kv_heads} kv heads, head_dim {dim}, {'E4M3' if fp8 else 'float32'} K and V",
                      "softmax_scale": softmax_scale, **slopes, "q": q, "k": k, "v": v}
            if fp8:
                inputs.update(k_scale=k_scale, v_scale=v_scale)
            diagnoses = _diagnose(candidates, args, slopes, actual, tol)
            raise KernelCheckFailed(report_of("prefill", inputs, "out", ok, expected, actual,
                                              tolerance_text(operands), diagnoses))

    run()


# ---------------------------------------------------------------------------- the paged cache write



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
                                                "written scales within 4 float32 ulps of amax / 448, the others untouched (NaN)",
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
