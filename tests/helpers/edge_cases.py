"""Inputs random data never reaches, shared by the edge-case tests of every view (``test_edge_ties_and_scores*``).

- Rounding ties: ``BF16_TIES`` (float32 patterns whose low 16 bits are exactly half a BF16 ulp, with the BF16
  pattern round-to-nearest-even gives, derived by hand), ``bf16_cases`` (that table, both signs),
  ``every_bf16_tie`` (all 65,280 finite ones), ``e4m3_midpoints`` (every midpoint between neighbouring E4M3
  values, with the even code) and ``tie_row`` (midpoints times ``2^k`` in a row whose amax makes the
  quantizer's scale exactly ``2^k``, so the scaled values are the ties themselves).
- Attention with huge scores: ``score_cases`` (scores of 100 to 10,000, one key far above the others, all
  scores equal and huge of both signs), over ``HEAD_DIM``-wide heads; ``paged_batch`` writes them into one
  paged cache (the simulator's view), ``kernel_caches`` gives a kernel's arrays of it, ``decode_oracle`` is
  float64 attention over what the cache stores (``stored_values``) and ``check_decode_bound`` the split-kv
  float32 bound around it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fp8lab.reference import e4m3, kv_cache
from fp8lab.reference import strategies as fst
from helpers.attention import tolerance

# ---------------------------------------------------------------------------- BF16 ties

BF16_TIES = [
    (0x3F808000, 0x3F80),  # 1 + 2^-8: 1.0 (mantissa 0, even) stays
    (0x3F818000, 0x3F82),  # 1 + 2^-7 + 2^-8: odd 0x3F81 rounds up to 1 + 2^-6
    (0x3FFF8000, 0x4000),  # 1.9921875 + 2^-8: odd, the carry runs into the exponent: 2.0
    (0x3F7F8000, 0x3F80),  # 0.99609375 + 2^-9: odd, carries into the exponent: 1.0
    (0x3F7E8000, 0x3F7E),  # even, stays
    (0x00008000, 0x0000),  # half the smallest BF16 subnormal: to zero (even)
    (0x00018000, 0x0002),  # odd subnormal rounds up
    (0x007F8000, 0x0080),  # the largest subnormal's tie becomes the smallest normal
    (0x7F7E8000, 0x7F7E),  # near overflow, even: stays finite
    (0x7F7F8000, 0x7F80),  # the largest finite BF16 is odd: its tie overflows to +inf
    (0x7F7F7FFF, 0x7F7F),  # a hair below that tie: the largest finite BF16
    (0x3F808001, 0x3F81),  # just above a tie: up, whatever the parity
    (0x3F817FFF, 0x3F81),  # just below a tie: down, whatever the parity
]
"""(float32 bit pattern, the BF16 pattern it must round to): the tail 0x8000 is exactly half a BF16 ulp, so the
even one of the two neighbours wins. Entry 9 overflows to infinity."""
BF16_OVERFLOWING_TIE = 9


def bf16_cases() -> tuple[np.ndarray, np.ndarray]:
    """``BF16_TIES`` with both signs (the sign takes no part in the rounding): ``(float32 values, BF16 patterns)``."""
    bits = np.array([b for b, _ in BF16_TIES], np.uint32)
    want = np.array([w for _, w in BF16_TIES], np.uint16)
    return (np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32),
            np.concatenate([want, want | np.uint16(0x8000)]))


def every_bf16_tie() -> tuple[np.ndarray, np.ndarray]:
    """Every finite BF16 pattern ``u`` (both signs, subnormals, zero) with the low half 0x8000, all exact ties, and
    the pattern each rounds to, ``u + (u & 1)`` (odd mantissas up, even ones stay): ``(float32 values, BF16)``."""
    upper = np.arange(1 << 16, dtype=np.uint32)
    upper = upper[(upper & 0x7F80) != 0x7F80]  # exponent 0xFF with a 0x8000 tail is a NaN, not a tie
    return ((upper << 16) | 0x8000).view(np.float32), (upper + (upper & 1)).astype(np.uint16)


# ---------------------------------------------------------------------------- E4M3 ties


def e4m3_midpoints(signed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Every midpoint between neighbouring non-negative E4M3 values (codes 0x00..0x7E) and 464 (between 448 and
    the would-be 480), float64, with the even code of its two neighbours; ``signed``: the negatives too (float32)."""
    values = e4m3.VALUES[: e4m3.MAX_CODE + 1].astype(np.float64)
    mid = np.concatenate([(values[:-1] + values[1:]) / 2, [464.0]])
    lower = np.arange(mid.size)  # the code below midpoint i is i (codes are ordered like magnitudes)
    even = (lower + (lower & 1)).astype(np.uint8)  # the even one of codes i, i + 1
    if signed:
        return np.concatenate([mid, -mid]).astype(np.float32), np.concatenate([even, even | 0x80])
    return mid, even


def tie_row(rng, n: int, scale_exponent: int) -> tuple[np.ndarray, np.ndarray]:
    """A row of ``n`` E4M3 midpoints (random picks, parities and signs) and ``+-448``, all times
    ``2^scale_exponent``: its amax is ``448 * 2^k``, so the scale is exactly ``2^k`` and every scaled value is
    the tie itself. Returns ``(row float32, expected codes)``."""
    mid, even = e4m3_midpoints()
    pick = rng.choice(mid.size - 1, n - 2, replace=True)  # leave 464 out: it would raise amax above 448
    sign = rng.integers(0, 2, n - 2).astype(np.uint8)
    values = np.concatenate([np.where(sign, -mid[pick], mid[pick]), [448.0, -448.0]])
    codes = np.concatenate([even[pick] | (sign << 7), [0x7E, 0xFE]]).astype(np.uint8)
    order = rng.permutation(n)
    return np.ldexp(values[order], scale_exponent).astype(np.float32), codes[order]


# ---------------------------------------------------------------------------- attention with huge scores

HEAD_DIM = 32
SOFTMAX_SCALE = HEAD_DIM**-0.5


def unit(rng) -> np.ndarray:
    """A random unit vector of ``HEAD_DIM`` elements."""
    u = rng.standard_normal(HEAD_DIM)
    return u / np.linalg.norm(u)


def score_cases(rng, num_heads: int = 2) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """Per sequence ``(name, q[num_heads, D], k[L, 1, D], v[L, 1, D])``, float32, scores of 100 to 10,000."""
    cases = []
    for name, target, length in (("scaled_100", 100.0, 9), ("scaled_10000", 1e4, 13)):
        q = rng.standard_normal((num_heads, HEAD_DIM))
        k = rng.standard_normal((length, 1, HEAD_DIM))
        factor = np.sqrt(target / np.abs(SOFTMAX_SCALE * q @ k[:, 0].T).max())  # q and k scaled up alike
        cases.append((name, q * factor, k * factor, rng.standard_normal((length, 1, HEAD_DIM))))
    u = unit(rng)  # one key far above the others: their scores ~ +-20, key 5's ~ +5000
    k = rng.standard_normal((11, 1, HEAD_DIM))
    k[5, 0] = 1000 * u
    cases.append(("one_far_key", 30 * u + rng.standard_normal((num_heads, HEAD_DIM)), k,
                  rng.standard_normal((11, 1, HEAD_DIM))))
    u = unit(rng)  # all scores equal and huge: one key repeated; head 0 sees +8000 everywhere, head 1 -8000
    q = np.stack([100 * u, -100 * u] + [100 * u] * (num_heads - 2))
    cases.append(("equal_huge", q, np.broadcast_to(80 * u * np.sqrt(HEAD_DIM), (10, 1, HEAD_DIM)),
                  rng.standard_normal((10, 1, HEAD_DIM))))
    return [(n, q.astype(np.float32), np.ascontiguousarray(k, np.float32), v.astype(np.float32))
            for n, q, k, v in cases]


def paged_batch(rng, cases, fmt: str, block_size: int = 4) -> fst.PagedKVData:
    """The cases' K/V written by ``fp8lab.reference.kv_cache.write`` into one paged cache of ``fmt`` (``fp32``,
    ``bf16``, ``fp8``) over shuffled blocks, unused slots NaN; the simulator's view (a BF16 cache holds BF16
    values in float32)."""
    lens = np.array([k.shape[0] for _, _, k, _ in cases], np.int32)
    blocks = -(-lens // block_size)
    num_blocks = int(blocks.sum()) + 2
    pool = rng.permutation(num_blocks)
    tables = np.full((len(cases), int(blocks.max())), -1, np.int32)
    shape = (num_blocks, 1, block_size, HEAD_DIM)
    fp8 = fmt == "fp8"
    caches = [np.full(shape, 0x7F, np.uint8) if fp8 else np.full(shape, np.nan, np.float32) for _ in range(2)]
    scales = [np.full(shape[:3], np.nan, np.float32) if fp8 else None for _ in range(2)]
    start = 0
    for i, (_, _, k, v) in enumerate(cases):
        tables[i, : blocks[i]] = pool[start : start + blocks[i]]
        start += blocks[i]
        slots = kv_cache.slots_for_positions(tables[i], np.arange(lens[i]), block_size)
        for c, s, x in zip(caches, scales, (k, v)):
            kv_cache.write(c, s, x.astype(ml_dtypes.bfloat16).astype(np.float32) if fmt == "bf16" else x, slots)
    q = np.stack([c[1] for c in cases])
    return fst.PagedKVData(q, caches[0], caches[1], scales[0], scales[1], tables, lens, SOFTMAX_SCALE)


def kernel_caches(data: fst.PagedKVData, fmt: str) -> list[np.ndarray]:
    """``data``'s K and V caches as a kernel takes them (BF16 as uint16 patterns)."""
    caches = [data.k_cache, data.v_cache]
    return [c.astype(ml_dtypes.bfloat16).view(np.uint16) for c in caches] if fmt == "bf16" else caches


def stored_values(cache, scales, table, length: int) -> np.ndarray:
    """float64 ``[length, D]`` of kv head 0 as the cache stores it, decoded with ``ml_dtypes`` (FP8: the
    contract's float32 product ``decode(code) * scale``)."""
    pos, block_size = np.arange(length), cache.shape[2]
    blocks, offsets = np.asarray(table)[pos // block_size], pos % block_size
    raw = cache[blocks, 0, offsets]
    if scales is None:
        return raw.astype(np.float64)
    return (raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scales[blocks, 0, offsets][:, None]).astype(np.float64)


def decode_oracle(data: fst.PagedKVData) -> np.ndarray:
    """float64 decode attention with the max subtracted, one row per sequence (one kv head)."""
    out = np.zeros(data.q.shape)
    for i, length in enumerate(data.seq_lens):
        k = stored_values(data.k_cache, data.k_scale, data.block_tables[i], int(length))
        v = stored_values(data.v_cache, data.v_scale, data.block_tables[i], int(length))
        s = SOFTMAX_SCALE * data.q[i].astype(np.float64) @ k.T
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = (w @ v) / w.sum(axis=1, keepdims=True)
    return out


def check_decode_bound(data: fst.PagedKVData, got: np.ndarray, splits) -> None:
    """``got`` finite and within the split-kv bound (``helpers.attention.tolerance``; the largest over the
    split counts ``splits``) of ``decode_oracle``."""
    assert np.all(np.isfinite(got))
    error = np.max(np.abs(got - decode_oracle(data)), axis=-1)
    bound = np.max([tolerance(data, None, n) for n in splits], axis=0)
    assert np.all(error <= bound), (error, bound)
