"""Hypothesis strategies for property-testing FP8 kernels against fp8lab's oracles.

Needs ``hypothesis`` (``pip install "fp8lab[strategies]"``). Every strategy yields plain NumPy data, so a
foreign kernel (CUDA, Triton, C++) can be fed the same inputs as the oracle.

Testing your own blockwise FP8 GEMM against the oracle::

    import numpy as np
    from hypothesis import given, strategies as st
    from fp8lab.reference import blockwise, strategies as fst

    @given(w=fst.blockwise_weights(max_n=256, max_k=512), m=st.integers(1, 16), seed=st.integers(0, 2**32 - 1))
    def test_my_gemm(w, m, seed):
        a = np.random.default_rng(seed).standard_normal((m, w.k)).astype(np.float32)
        expected = blockwise.gemm(a, w.q, w.scale_inv, w.block)          # float64 oracle
        got = my_fp8_gemm(a, w.q, w.scale_inv, w.block)                   # your kernel
        err = np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30)
        assert np.all(np.isfinite(got)) and err < 1e-5

and your paged decode attention::

    from fp8lab.reference import attention, kv_cache

    @given(layout=fst.paged_kv_layouts(), seed=st.integers(0, 2**32 - 1))
    def test_my_decode(layout, seed):
        data = layout.random_data(np.random.default_rng(seed), fp8=True)
        expected = attention.paged_decode(*data.decode_args())
        got = my_paged_decode(*data.decode_args())
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from . import e4m3, kv_cache

# ---------------------------------------------------------------------------- E4M3 codes

NON_NAN_CODES = tuple(c for c in range(256) if c not in e4m3.NAN_CODES)


def e4m3_codes(shape=hnp.array_shapes(max_dims=2, max_side=64), allow_nan: bool = False) -> st.SearchStrategy:
    """uint8 arrays of E4M3 codes of ``shape`` (a shape or a strategy of shapes); NaN codes only if ``allow_nan``."""
    elements = st.integers(0, 255) if allow_nan else st.sampled_from(NON_NAN_CODES)
    return hnp.arrays(np.uint8, shape, elements=elements)


# ---------------------------------------------------------------------------- floats to encode


def _midpoints() -> np.ndarray:
    """The exact midpoints between neighbouring positive E4M3 values (ties of the rounding)."""
    values = e4m3.VALUES[: e4m3.MAX_CODE + 1].astype(np.float64)
    return (values[:-1] + values[1:]) / 2


BOUNDARY_VALUES = (0.0, e4m3.MIN_SUBNORMAL, e4m3.MIN_SUBNORMAL / 2, e4m3.MIN_NORMAL, 240.0, 448.0, 464.0, 480.0, 512.0)
"""Values where the encode policy changes: the subnormal threshold, the fnuz maximum 240, the
maximum 448, the last value that still rounds to 448 (464), the would-be next value 480."""


def e4m3_edge_floats(include_nonfinite: bool = True) -> st.SearchStrategy:
    """Scalar floats that stress an E4M3 encoder: exact ties, their float32 neighbours, subnormals,
    the 448/464/480 boundaries, values far beyond the range, +-0 and (optionally) NaN and +-inf."""
    midpoints = _midpoints()
    tie = st.sampled_from(midpoints.tolist())
    near = st.tuples(st.sampled_from(midpoints.tolist() + list(BOUNDARY_VALUES)), st.sampled_from([-1, 1]))
    near_tie = near.map(lambda t: float(np.nextafter(np.float32(t[0]), np.float32(t[1] * np.inf))))
    in_range = st.floats(-e4m3.MAX, e4m3.MAX, width=32)
    subnormal = st.floats(-e4m3.MIN_NORMAL, e4m3.MIN_NORMAL, width=32)
    beyond = st.floats(-1e6, 1e6, width=32)
    parts = [tie, near_tie, st.sampled_from(BOUNDARY_VALUES), in_range, subnormal, beyond]
    if include_nonfinite:
        parts.append(st.sampled_from([np.nan, np.inf, -np.inf]))
    magnitude = st.one_of(*parts)
    return st.tuples(magnitude, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])


def e4m3_float_arrays(shape=hnp.array_shapes(max_dims=2, max_side=64), dtype=np.float32, include_nonfinite=True):
    """Float arrays of ``dtype`` whose elements come from ``e4m3_edge_floats``."""
    return hnp.arrays(dtype, shape, elements=e4m3_edge_floats(include_nonfinite), fill=st.nothing())


FLOAT32_EXTREMES = (np.nan, np.inf, -np.inf, float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max),
                    2.0**-149, -(2.0**-149), 2.0**-130, -0.0, 0.0)
"""float32 values an oracle must not mishandle: NaN, +-inf, the largest finite, the smallest
subnormal, a subnormal, -0.0 and 0.0."""


def float32_arrays_with_extremes(shape, extreme_fraction: float = 0.2) -> st.SearchStrategy:
    """float32 arrays of ``shape`` (a shape or a strategy of shapes): ordinary values in
    ``[-4, 4]``, with about ``extreme_fraction`` of the elements drawn from ``FLOAT32_EXTREMES``."""
    ordinary = st.floats(-4, 4, width=32)
    extreme = st.sampled_from(FLOAT32_EXTREMES)
    element = st.tuples(st.floats(0, 1), ordinary, extreme).map(lambda t: t[2] if t[0] < extreme_fraction else t[1])
    return hnp.arrays(np.float32, shape, elements=element, fill=st.nothing())


# ---------------------------------------------------------------------------- blockwise weights


@dataclass(frozen=True)
class BlockwiseWeight:
    """A block-quantized weight: ``q[N, K]`` codes, ``scale_inv[ceil(N/BN), ceil(K/BK)]`` float32."""

    q: np.ndarray
    scale_inv: np.ndarray
    block: tuple[int, int]

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]


@st.composite
def blockwise_weights(
    draw,
    max_n: int = 96,
    max_k: int = 96,
    block=None,
    k_multiple: int = 1,
    power_of_two_scales: bool = False,
) -> BlockwiseWeight:
    """Random blockwise FP8 weights: random codes (no NaN codes) and positive float32 scales.

    ``block`` fixes ``(BN, BK)``; by default it is drawn, often not dividing N or K, so edge
    blocks are partial. ``k_multiple`` forces K to a multiple (kernels that need K % 128 == 0).
    ``power_of_two_scales`` keeps every product exact, for bit-exact comparisons.
    """
    if block is None:
        block = (draw(st.sampled_from([1, 3, 8, 16, 32, 128])), draw(st.sampled_from([1, 5, 16, 32, 128])))
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, max(1, max_k // k_multiple))) * k_multiple
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.choice(np.array(NON_NAN_CODES, dtype=np.uint8), size=(n, k))
    nb, kb = -(-n // block[0]), -(-k // block[1])
    if power_of_two_scales:
        scale_inv = np.ldexp(1.0, rng.integers(-12, 4, size=(nb, kb))).astype(np.float32)
    else:
        scale_inv = (rng.uniform(0.5, 2.0, size=(nb, kb)) * 10.0 ** rng.uniform(-4, 0, size=(nb, kb))).astype(np.float32)
    return BlockwiseWeight(q=q, scale_inv=scale_inv, block=(int(block[0]), int(block[1])))


# ---------------------------------------------------------------------------- paged KV layouts


@dataclass(frozen=True)
class PagedKVData:
    """Filled paged caches plus the decode query; ``decode_args()`` is ``paged_decode``'s arguments."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None
    block_tables: np.ndarray
    seq_lens: np.ndarray
    softmax_scale: float

    def decode_args(self) -> tuple:
        """``(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale)``."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.softmax_scale, self.k_scale, self.v_scale)


@dataclass(frozen=True)
class PagedKVLayout:
    """Shapes and block bookkeeping of a batch of sequences in a paged KV cache.

    Each sequence owns distinct blocks (``block_tables`` rows, padded with ``-1`` past the blocks
    it needs, which a kernel must never read); ``seq_lens`` may be 0.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    block_tables: np.ndarray
    seq_lens: np.ndarray

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def random_data(self, rng: np.random.Generator, fp8: bool = True) -> PagedKVData:
        """Fill every sequence's tokens with random K/V (FP8 codes + scales, or float32) and draw a query.

        Unused cache slots hold NaN (float cache) or NaN codes with NaN scales (FP8 cache), so a
        kernel that reads outside a sequence is caught.
        """
        shape = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        caches = []
        for _ in range(2):
            if fp8:
                cache, scales = np.full(shape, 0x7F, np.uint8), np.full(shape[:3], np.nan, np.float32)
            else:
                cache, scales = np.full(shape, np.nan, np.float32), None
            for table, length in zip(self.block_tables, self.seq_lens):
                x = rng.standard_normal((int(length), self.num_kv_heads, self.head_dim)).astype(np.float32)
                x *= rng.uniform(0.1, 4.0, size=(int(length), self.num_kv_heads, 1)).astype(np.float32)
                slots = kv_cache.slots_for_positions(table, np.arange(length), self.block_size)
                kv_cache.write(cache, scales, x, slots)
            caches.append((cache, scales))
        q = rng.standard_normal((self.num_seqs, self.num_heads, self.head_dim)).astype(np.float32)
        (k_cache, k_scale), (v_cache, v_scale) = caches
        return PagedKVData(q, k_cache, v_cache, k_scale, v_scale, self.block_tables, self.seq_lens,
                           softmax_scale=float(self.head_dim) ** -0.5)


@st.composite
def paged_kv_layouts(
    draw,
    max_seqs: int = 4,
    max_seq_len: int = 40,
    block_sizes=(1, 2, 4, 8, 16),
    head_dims=(4, 8, 16, 64),
    max_kv_heads: int = 3,
    gqa_ratios=(1, 2, 4),
    spare_blocks: int = 3,
) -> PagedKVLayout:
    """Random paged KV layouts: block size, GQA ratio, head_dim, seq_lens (0 included) and block
    tables that use a random permutation of the pool, with some spare blocks left unused."""
    block_size = draw(st.sampled_from(block_sizes))
    num_kv_heads = draw(st.integers(1, max_kv_heads))
    num_heads = num_kv_heads * draw(st.sampled_from(gqa_ratios))
    head_dim = draw(st.sampled_from(head_dims))
    num_seqs = draw(st.integers(1, max_seqs))
    seq_lens = np.array(draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, max_seq_len)),
                                      min_size=num_seqs, max_size=num_seqs)), dtype=np.int32)
    blocks_needed = -(-seq_lens // block_size)
    max_blocks = max(1, int(blocks_needed.max()))
    num_blocks = int(blocks_needed.sum()) + draw(st.integers(0, spare_blocks))
    num_blocks = max(num_blocks, 1)
    pool = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(num_blocks)
    block_tables = np.full((num_seqs, max_blocks), -1, dtype=np.int32)
    start = 0
    for i, needed in enumerate(blocks_needed):
        block_tables[i, :needed] = pool[start : start + needed]
        start += needed
    return PagedKVLayout(num_heads, num_kv_heads, head_dim, block_size, num_blocks, block_tables, seq_lens)
