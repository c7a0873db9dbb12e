"""fp8lab.reference.strategies produce what their docstrings promise, and the module docstring's recipe runs."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8lab.reference import attention, blockwise, e4m3
from fp8lab.reference import strategies as fst


@given(fst.e4m3_codes())
def test_codes_have_no_nan_by_default(codes):
    assert codes.dtype == np.uint8 and not e4m3.is_nan(codes).any()


def test_edge_floats_cover_ties_boundaries_and_specials():
    seen = []

    @settings(max_examples=400, derandomize=True)
    @given(fst.e4m3_edge_floats())
    def collect(x):
        seen.append(x)

    collect()
    xs = np.array(seen)
    midpoints = set(fst._midpoints().tolist())
    assert any(abs(x) in midpoints for x in xs)  # exact ties
    assert np.isnan(xs).any() and np.isinf(xs).any()
    assert (np.abs(xs[np.isfinite(xs)]) > 464).any()  # overflow
    assert ((np.abs(xs) > 0) & (np.abs(xs) < e4m3.MIN_NORMAL)).any()  # subnormals
    assert (xs < 0).any() and (xs > 0).any()


@given(fst.blockwise_weights())
def test_blockwise_weights_are_consistent(w):
    assert w.q.dtype == np.uint8 and not e4m3.is_nan(w.q).any()
    assert w.scale_inv.shape == blockwise.scale_shape(w.q.shape, w.block)
    assert w.scale_inv.dtype == np.float32 and np.all(w.scale_inv > 0)


@given(fst.paged_kv_layouts())
def test_paged_layouts_give_each_sequence_its_own_blocks(layout):
    needed = -(-layout.seq_lens // layout.block_size)
    used = np.concatenate([row[:n] for row, n in zip(layout.block_tables, needed)])
    assert len(set(used.tolist())) == used.size  # no block owned twice
    assert used.size == 0 or (used.min() >= 0 and used.max() < layout.num_blocks)
    assert layout.num_heads % layout.num_kv_heads == 0


def test_the_module_docstring_recipe_runs():
    """The 'test your own kernel' recipe, with the oracle standing in for a foreign kernel."""

    @given(w=fst.blockwise_weights(max_n=64, max_k=160), m=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
    def check_gemm(w, m, seed):
        a = np.random.default_rng(seed).standard_normal((m, w.k)).astype(np.float32)
        expected = blockwise.gemm(a, w.q, w.scale_inv, w.block)
        got = (a @ blockwise.dequantize(w.q, w.scale_inv, w.block).T).astype(np.float32)  # a float32 "kernel"
        err = np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30)
        assert np.all(np.isfinite(got)) and err < 1e-5

    @given(layout=fst.paged_kv_layouts(), seed=st.integers(0, 2**32 - 1))
    def check_decode(layout, seed):
        data = layout.random_data(np.random.default_rng(seed), fp8=True)
        expected = attention.paged_decode(*data.decode_args())
        np.testing.assert_allclose(attention.paged_decode(*data.decode_args()), expected, rtol=1e-3, atol=1e-3)

    check_gemm()
    check_decode()
