"""The bug zoo: one deliberately wrong implementation per bug class of ``fp8lab.testing.bugs``, written
here independently of the catalog's mutants (with ml_dtypes casts and block loops, as a kernel author
might), and the kit must fail every one and name its class; fp8lab's own oracle and the simulators of
its kernels must pass."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp8lab import testing
from fp8lab.reference import blockwise, e4m3, kv_cache
from fp8lab.simulators import gemv_simt, splitkv

FN = ml_dtypes.float8_e4m3fn


def cast_saturating(x) -> np.ndarray:
    """E4M3 codes by ml_dtypes (round to nearest even), saturated to +-448 first: a correct encoder."""
    x = np.asarray(x, np.float32)
    clipped = np.where(np.isnan(x), x, np.clip(x, -448, 448))
    return clipped.astype(FN).view(np.uint8)


# ---------------------------------------------------------------------------- the zoo


def encode_ties_away(x):
    """Rounds a tie to the neighbour of larger magnitude: where ml_dtypes' cast (ties to even) rounded a
    tie down in magnitude, step one code up (codes are ordered like magnitudes within a sign)."""
    codes = cast_saturating(x)
    x = np.abs(np.asarray(x, np.float64))
    magnitude = codes & 0x7F
    value = np.abs(e4m3.decode(codes).astype(np.float64))
    above = np.abs(e4m3.decode(np.minimum(magnitude + 1, 0x7E).astype(np.uint8)).astype(np.float64))
    rounded_down_a_tie = (value < x) & (x - value == above - x) & (magnitude < 0x7E)
    return np.where(rounded_down_a_tie, codes + 1, codes).astype(np.uint8)


def encode_nan_on_overflow(x):
    """ml_dtypes' plain cast: NaN on overflow, though the caller asked to saturate."""
    return np.asarray(x, np.float32).astype(FN).view(np.uint8)


def encode_fnuz_max(x):
    """Clamps to +-240 (the e4m3fnuz maximum) before a correct cast."""
    x = np.asarray(x, np.float32)
    return cast_saturating(np.where(np.isnan(x), x, np.clip(x, -240, 240)))


def encode_subnormal_off(x):
    """Subnormal mantissas computed as round(|x| * 2^10) (one power of two too many), clamped to 7."""
    codes = cast_saturating(x)
    x = np.asarray(x, np.float64)
    small = np.abs(x) < 2.0**-6
    m = np.minimum(np.rint(np.where(small, np.abs(x), 0.0) * 1024), 7).astype(np.uint8)
    return np.where(small, m | (np.signbit(x).astype(np.uint8) << 7), codes).astype(np.uint8)


def decode_fnuz(codes):
    """Reads the codes as float8_e4m3fnuz (bias 8): every value halved, 0x80 the only NaN."""
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)


def decode_subnormal_off(codes):
    """Subnormal codes decoded as m * 2^-10."""
    codes = np.asarray(codes, np.uint8)
    values = codes.view(FN).astype(np.float32)
    sub = (codes & 0x78) == 0
    m = (codes & 7).astype(np.float32) * np.float32(2.0**-10)
    return np.where(sub, np.where(codes & 0x80, -m, m), values).astype(np.float32)


def blocks(shape, block):
    """(row slice, column slice, block row, block column) of every block of a weight, partial edges included."""
    n, k = shape
    for bi, r in enumerate(range(0, n, block[0])):
        for bj, c in enumerate(range(0, k, block[1])):
            yield slice(r, r + block[0]), slice(c, c + block[1]), bi, bj


def quantize_per_tensor(w, block):
    amax = np.float32(np.max(np.abs(w)))
    scale = np.float32(1) if amax == 0 else max(amax / np.float32(448), np.float32(2.0**-126))
    grid = np.full(blockwise.scale_shape(w.shape, block), scale, np.float32)
    return cast_saturating(w / scale), grid


def quantize_multiplied(w, block):
    q, s = np.zeros(w.shape, np.uint8), np.zeros(blockwise.scale_shape(w.shape, block), np.float32)
    for rows, cols, bi, bj in blocks(w.shape, block):
        amax = np.float32(np.max(np.abs(w[rows, cols])))
        s[bi, bj] = np.float32(1) if amax == 0 else max(amax / np.float32(448), np.float32(2.0**-126))
        q[rows, cols] = cast_saturating(w[rows, cols] * s[bi, bj])
    return q, s


def quantize_swapped(w, block):
    return blockwise.quantize(w, (block[1], block[0]))


def dequantize_divided(q, s, block):
    out = np.zeros(q.shape, np.float32)
    for rows, cols, bi, bj in blocks(q.shape, block):
        with np.errstate(over="ignore"):
            out[rows, cols] = q[rows, cols].view(FN).astype(np.float32) / s[bi, bj]
    return out


def dequantize_swapped(q, s, block):
    n, k = q.shape
    rows = np.minimum(np.arange(n) // block[1], s.shape[0] - 1)
    cols = np.minimum(np.arange(k) // block[0], s.shape[1] - 1)
    return q.view(FN).astype(np.float32) * s[rows][:, cols]


def dequantize_edge_clamped(q, s, block):
    out = np.zeros(q.shape, np.float32)
    full_rows, full_cols = max(q.shape[0] // block[0], 1), max(q.shape[1] // block[1], 1)
    for rows, cols, bi, bj in blocks(q.shape, block):
        out[rows, cols] = q[rows, cols].view(FN).astype(np.float32) * s[min(bi, full_rows - 1), min(bj, full_cols - 1)]
    return out


def gemm_over(dequantize):
    """A float32 GEMM over a (possibly wrong) dequantizer; a wrong one may overflow, as the kernel would."""
    def gemm(a, q, s, block):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(a, np.float32) @ dequantize(q, s, block).T
    return gemm


def activations_without_eps(a, group, eps):
    q, s = np.zeros(a.shape, np.uint8), np.zeros((a.shape[0], -(-a.shape[1] // group)), np.float32)
    for j, c in enumerate(range(0, a.shape[1], group)):
        s[:, j] = np.max(np.abs(a[:, c : c + group]), axis=1) / np.float32(448)
        with np.errstate(invalid="ignore", divide="ignore"):
            q[:, c : c + group] = cast_saturating(a[:, c : c + group] / s[:, j : j + 1])
    return q, s


def kv_quantize_per_token(x):
    """One scale per token over all its heads (the whole ``[kv_heads, head_dim]`` slice)."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).reshape(x.shape[0], -1).max(axis=1)
    scale = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
    scales = np.repeat(scale[:, None], x.shape[1], axis=1).astype(np.float32)
    return cast_saturating(x / scales[..., None]), scales


def my_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, *,
              kv_head_of=lambda h, hq, hkv: h // (hq // hkv), empty_row=0.0, splits=None):
    """A decode written out by hand: gather each token through the block table, dequantize, softmax in
    float64. The keywords plant one bug each: the head mapping, what a length-0 row gets, and a
    split-kv combine over ``splits`` shards of whole blocks with no -inf guard."""
    block_size, num_heads, num_kv = k_cache.shape[2], q.shape[1], k_cache.shape[1]

    def value(cache, scale, block, g, offset):
        row = cache[block, g, offset]
        if scale is None:
            return row.astype(np.float64)
        return row.view(FN).astype(np.float64) * float(scale[block, g, offset])

    out = np.zeros(q.shape)
    for s, length in enumerate(seq_lens):
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv)
            if length == 0:
                out[s, h] = empty_row
                continue
            k = np.array([value(k_cache, k_scale, block_tables[s, j // block_size], g, j % block_size) for j in range(length)])
            v = np.array([value(v_cache, v_scale, block_tables[s, j // block_size], g, j % block_size) for j in range(length)])
            scores = k @ q[s, h].astype(np.float64) * softmax_scale
            if splits is None:
                w = np.exp(scores - scores.max())
                out[s, h] = w @ v / w.sum()
                continue
            blocks = -(-length // block_size)
            per = -(-blocks // splits)
            parts = []  # flash-decoding's normalized partials: (lse_s, o_s = acc_s / l_s) per shard
            for p in range(splits):
                lo, hi = min(p * per * block_size, length), min((p + 1) * per * block_size, length)
                m = scores[lo:hi].max() if hi > lo else -np.inf
                with np.errstate(invalid="ignore", divide="ignore"):
                    w = np.exp(scores[lo:hi] - m)
                    acc = w @ v[lo:hi] if hi > lo else np.zeros(v.shape[1])
                    parts.append((m + np.log(w.sum()), acc / w.sum()))  # an empty shard: (-inf, 0 / 0 = NaN)
            lse_max = max(p[0] for p in parts)
            with np.errstate(invalid="ignore"):
                # no guard: an empty shard's weight exp(-inf) = 0 times its NaN partial is NaN
                out[s, h] = sum(np.exp(p[0] - lse_max) * p[1] for p in parts)
                out[s, h] /= sum(np.exp(p[0] - lse_max) for p in parts)
    return out


def w8a8_without_eps(a, q, s, block, eps):
    """W8A8 as transformers' block loop writes it, but its activation scales have no epsilon."""
    aq, a_s = activations_without_eps(a, block[1], eps)
    out = np.zeros((a.shape[0], q.shape[0]), np.float64)
    for rows, cols, bi, bj in blocks(q.shape, block):
        with np.errstate(invalid="ignore"):
            x = aq[:, cols].view(FN).astype(np.float64) * a_s[:, bj : bj + 1]
        out[:, rows] += x @ (q[rows, cols].view(FN).astype(np.float64) * s[bi, bj]).T
    return out


def w8a8_float32(a, q, s, block, eps):
    """A correct W8A8 in float32, block by block as a kernel accumulates (the contract's activation scales)."""
    aq, a_s = blockwise.quantize_activations(a, block[1], eps)
    out = np.zeros((a.shape[0], q.shape[0]), np.float32)
    for rows, cols, bi, bj in blocks(q.shape, block):
        partial = aq[:, cols].view(FN).astype(np.float32) @ q[rows, cols].view(FN).astype(np.float32).T
        out[:, rows] += partial * (a_s[:, bj : bj + 1] * s[bi, bj])
    return out


def write_token_loop(k, v, k_cache, v_cache, k_scale, v_scale, slots, *, per_token_scale=False, wrap_padding=False,
                     token_major=False, vllm_layout=False):
    """A paged FP8 write one token at a time, with ml_dtypes casts; the keywords plant one bug each (or,
    ``vllm_layout``, write a correct ``[blocks, block_size, heads, dim]`` cache)."""
    block_size = k_cache.shape[1] if vllm_layout else k_cache.shape[2]
    heads = k.shape[1]
    for t, slot in enumerate(slots):
        if slot < 0 and not wrap_padding:
            continue
        block, offset = divmod(int(slot) % (k_cache.shape[0] * block_size), block_size)
        for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            amax = np.abs(x[t]).max(axis=-1)
            if per_token_scale:
                amax = np.full(heads, np.abs(x[t]).max())
            s = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
            codes = cast_saturating(x[t] / s[:, None].astype(np.float32))
            for h in range(heads):
                if vllm_layout:
                    cache[block, offset, h], scales[block, offset, h] = codes[h], s[h]
                elif token_major:  # [offset, head] flattened into a [head, offset] cache
                    flat = offset * heads + h
                    cache[block, flat // block_size, flat % block_size], scales[block, flat // block_size, flat % block_size] = codes[h], s[h]
                else:
                    cache[block, h, offset], scales[block, h, offset] = codes[h], s[h]


ZOO = [
    ("ties_away_from_zero", lambda: testing.check_e4m3_encode(encode_ties_away)),
    ("overflow_policy_swapped", lambda: testing.check_e4m3_encode(encode_nan_on_overflow)),
    ("fnuz_max_240", lambda: testing.check_e4m3_encode(encode_fnuz_max)),
    ("subnormal_wrong_power_of_two", lambda: testing.check_e4m3_encode(encode_subnormal_off)),
    ("fnuz_max_240", lambda: testing.check_e4m3_decode(decode_fnuz)),
    ("subnormal_wrong_power_of_two", lambda: testing.check_e4m3_decode(decode_subnormal_off)),
    ("per_tensor_scale", lambda: testing.check_blockwise_quantize(quantize_per_tensor)),
    ("scale_multiplied_not_divided", lambda: testing.check_blockwise_quantize(quantize_multiplied)),
    ("wrong_block_dimension", lambda: testing.check_blockwise_quantize(quantize_swapped, block=(64, 128))),
    ("scale_multiplied_not_divided", lambda: testing.check_blockwise_dequantize(dequantize_divided)),
    ("wrong_block_dimension", lambda: testing.check_blockwise_dequantize(dequantize_swapped, block=(64, 128))),
    ("partial_edge_block", lambda: testing.check_blockwise_dequantize(dequantize_edge_clamped)),
    ("scale_multiplied_not_divided", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_divided))),
    ("wrong_block_dimension", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_swapped), block=(64, 128))),
    ("partial_edge_block", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_edge_clamped))),
    ("group_scale_without_eps", lambda: testing.check_activation_quantize(activations_without_eps)),
    ("group_scale_without_eps", lambda: testing.check_w8a8_gemm(w8a8_without_eps)),
    ("kv_scale_over_all_heads", lambda: testing.check_kv_quantize(kv_quantize_per_token)),
    ("kv_scale_over_all_heads", lambda: testing.check_paged_cache_write(
        lambda *a: write_token_loop(*a, per_token_scale=True))),
    ("padding_slot_written", lambda: testing.check_paged_cache_write(lambda *a: write_token_loop(*a, wrap_padding=True))),
    ("wrong_cache_layout", lambda: testing.check_paged_cache_write(lambda *a: write_token_loop(*a, token_major=True))),
    ("wrong_head_mapping", lambda: testing.check_paged_decode(
        lambda *a: my_decode(*a, kv_head_of=lambda h, hq, hkv: h % hkv))),
    ("length_zero_rows_not_zero", lambda: testing.check_paged_decode(lambda *a: my_decode(*a, empty_row=np.nan))),
    ("missing_neg_inf_guard", lambda: testing.check_paged_decode(lambda *a: my_decode(*a, splits=4))),
]


@pytest.mark.parametrize("bug, check", ZOO, ids=[f"{i}-{bug}" for i, (bug, _) in enumerate(ZOO)])
def test_the_kit_fails_every_bug_and_names_its_class(bug, check):
    with pytest.raises(testing.KernelCheckFailed) as failure:
        check()
    names = [b.name for b in failure.value.report.diagnoses]
    assert bug in names, str(failure.value)
    assert bug in str(failure.value)


def test_every_bug_class_has_a_zoo_entry():
    assert {b.name for b in testing.CATALOG} == {bug for bug, _ in ZOO}


# ---------------------------------------------------------------------------- what must pass


def test_the_oracle_and_correct_peers_pass():
    testing.check_e4m3_encode(e4m3.encode)
    testing.check_e4m3_encode(lambda x: e4m3.encode(x, saturate=False), saturate=False)
    testing.check_e4m3_encode(cast_saturating)  # ml_dtypes behind a saturating clip: correct
    testing.check_e4m3_encode(encode_nan_on_overflow, saturate=False)  # ml_dtypes' cast IS the NaN policy
    testing.check_e4m3_decode(e4m3.decode)
    testing.check_e4m3_decode(lambda c: np.asarray(c, np.uint8).view(FN).astype(np.float32))
    testing.check_blockwise_quantize(blockwise.quantize, block=(64, 128))
    testing.check_blockwise_dequantize(blockwise.dequantize)
    testing.check_activation_quantize(blockwise.quantize_activations)
    testing.check_w8a8_gemm(lambda a, q, s, block, eps: blockwise.gemm_w8a8(a, q, s, block, eps))
    testing.check_w8a8_gemm(w8a8_float32)  # float32 accumulation in blocks: within the stated bound
    testing.check_kv_quantize(kv_cache.quantize_kv)
    testing.check_paged_cache_write(write_token_loop)  # the loop without a planted bug
    testing.check_paged_cache_write(lambda *a: write_token_loop(*a, vllm_layout=True), layout="vllm")
    testing.check_paged_decode(lambda *a: my_decode(*a))  # the hand-written decode without a planted bug
    testing.check_paged_decode(lambda *a: my_decode(*a), fp8=False)


def test_the_split_kv_simulator_passes():
    """The bit-exact model of fp8lab's split-kv decode kernel (auto splits, log2-domain combine)."""
    testing.check_paged_decode(lambda *a: splitkv.paged_decode(*a), max_examples=15)


def test_the_simulators_of_fp8labs_gemm_kernels_pass():
    """The bit-exact model of the SIMT GEMV kernel on float32 activations (it needs K % 128 == 0)."""
    testing.check_blockwise_gemm(lambda a, q, s, block: gemv_simt.gemv_simt(a, q, s, block), k_multiple=128,
                                 max_examples=15)


def test_a_report_says_what_is_wrong():
    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_e4m3_encode(encode_nan_on_overflow)
    report = failure.value.report
    assert report.operator == "e4m3 encode (saturate=True)" and report.inputs["x"].size == 1
    assert (report.expected, report.actual) == ("0x7E", "0x7F") and report.tolerance == "exact"
    text = str(failure.value)
    assert "smallest failing input" in text and "overflow_policy_swapped" in text
