"""The paged KV cache manager: a Hypothesis state machine over many sequences, plus the storage
(BF16 rounding, FP8 codes need scales, poisoned fresh caches, the bytes of a block)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fp8lab.engine.backend import ReferenceBackend
from fp8lab.engine.kv_manager import (
    BlockAllocator,
    KVCacheExhausted,
    KVCacheManager,
    LayerKVCache,
    allocate_kv_cache,
    blocks_for,
    kv_block_bytes,
)
from fp8lab.reference import kv_cache
from fp8lab.reference.dense import round_to_bf16

NUM_BLOCKS, BLOCK_SIZE = 12, 3


class KVCacheMachine(RuleBasedStateMachine):
    """Add, append to (one or several at once) and free sequences in a small pool, against a
    shadow model of the lengths; exhaustion must raise and leave every piece of state unchanged."""

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.lengths: dict[int, int] = {}  # the shadow model
        self.slots: dict[int, list[int]] = {}  # slots handed out per sequence, in position order
        self.next_id = 0

    def _snapshot(self):
        m = self.manager
        return ({s: m.block_table(s) for s in m.sequences}, {s: m.context_len(s) for s in m.sequences},
                list(m.allocator._free), set(m.allocator._used))

    def _append(self, requests: dict[int, int]) -> None:
        needed = sum(blocks_for(self.lengths[s] + n, BLOCK_SIZE) - blocks_for(self.lengths[s], BLOCK_SIZE)
                     for s, n in requests.items())
        before = self._snapshot()
        if needed > self.manager.num_free_blocks:
            with pytest.raises(KVCacheExhausted) as info:
                self.manager.append_batch(requests)
            assert (info.value.needed, info.value.free) == (needed, self.manager.num_free_blocks)
            assert self._snapshot() == before  # nothing changed
            return
        slots = self.manager.append_batch(requests)
        for s, n in requests.items():
            assert len(slots[s]) == n
            self.slots[s].extend(int(x) for x in slots[s])
            self.lengths[s] += n

    @rule()
    def add(self):
        self.manager.add_sequence(self.next_id)
        self.lengths[self.next_id], self.slots[self.next_id] = 0, []
        self.next_id += 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), n=st.integers(0, 8))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self._append({seq: n})

    @precondition(lambda self: len(self.lengths) >= 2)
    @rule(data=st.data())
    def append_several(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.lengths)), min_size=2, max_size=4, unique=True))
        self._append({s: data.draw(st.integers(0, 5)) for s in seqs})

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self.manager.free(seq)
        del self.lengths[seq], self.slots[seq]

    @invariant()
    def no_block_owned_twice_and_none_lost(self):
        m = self.manager
        owned = [b for s in m.sequences for b in m.block_table(s)]
        assert len(owned) == len(set(owned))
        assert set(owned) == m.allocator._used
        assert m.num_free_blocks + len(owned) == NUM_BLOCKS
        assert not set(owned) & set(m.allocator._free)

    @invariant()
    def tables_hold_exactly_the_blocks_the_lengths_need(self):
        for s, length in self.lengths.items():
            assert self.manager.context_len(s) == length
            assert len(self.manager.block_table(s)) == blocks_for(length, BLOCK_SIZE)

    @invariant()
    def slots_are_distinct_and_follow_the_block_tables(self):
        everything = [x for slots in self.slots.values() for x in slots]
        assert len(everything) == len(set(everything))
        for s, slots in self.slots.items():
            table = self.manager.block_table(s)
            expected = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(self.lengths[s])]
            assert slots == expected
            assert self.manager.slots(s, np.arange(self.lengths[s])).tolist() == expected

    def teardown(self):
        for s in list(self.lengths):
            self.manager.free(s)
        assert self.manager.num_free_blocks == NUM_BLOCKS and not self.manager.allocator._used


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(stateful_step_count=30)


def test_exhaustion_error_names_the_numbers():
    m = KVCacheManager(num_blocks=2, block_size=4)
    m.add_sequence("a")
    m.append("a", 5)
    with pytest.raises(KVCacheExhausted, match="2 blocks needed, 0 free") as info:
        m.append("a", 8)
    assert isinstance(info.value, RuntimeError)
    assert m.context_len("a") == 5 and m.block_table("a") == [0, 1]


def test_double_free_and_unknown_sequences_are_errors():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    a.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        a.free(blocks[:1])
    m = KVCacheManager(4, 2)
    with pytest.raises(KeyError, match="add_sequence"):
        m.append("nope", 1)
    m.add_sequence("x")
    with pytest.raises(ValueError, match="already"):
        m.add_sequence("x")


def test_block_tables_are_padded_with_minus_one():
    m = KVCacheManager(8, 2)
    for s, n in (("a", 5), ("b", 1)):
        m.add_sequence(s)
        m.append(s, n)
    tables = m.block_tables(["a", "b"])
    assert tables.dtype == np.int32 and tables.tolist() == [[0, 1, 2], [3, -1, -1]]


# ---------------------------------------------------------------------------- storage


@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200))
def test_round_to_bf16_matches_ml_dtypes(bits):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array(bits, dtype=np.uint32).view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < np.float32(3.3e38))]  # beyond the largest BF16 both overflow
    np.testing.assert_array_equal(round_to_bf16(x), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_round_to_bf16_ties_go_to_even():
    one_and_half_ulp = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)  # halfway cases
    assert round_to_bf16(one_and_half_ulp).tolist() == [1.0, 1 + 2**-6]


def test_fp8_cache_without_scales_is_an_error():
    shape = (2, 1, 4, 8)
    with pytest.raises(ValueError, match="scales"):
        LayerKVCache(np.zeros(shape, np.uint8), np.zeros(shape, np.uint8), None, None, "fp8")
    with pytest.raises(ValueError, match="k cache: holds float32, but kv_format fp8 is stored as uint8"):
        LayerKVCache(np.zeros(shape, np.float32), np.zeros(shape, np.float32), None, None, "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        allocate_kv_cache(1, 2, 1, 4, 8, "int8")


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_fresh_caches_are_poisoned_and_writes_land_in_their_slots(dtype, rng):
    (layer,) = allocate_kv_cache(1, num_blocks=3, num_kv_heads=2, block_size=4, head_dim=8, kv_format=dtype)
    k, v = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    slots = [11, 0, 5, 6, 3]
    ReferenceBackend().write_kv(layer, k, v, np.array(slots))
    table = [2, 0, 1]  # a sequence whose positions 0..11 are the slots 8..11, 0..3, 4..7
    got = kv_cache.gather(layer.k, layer.k_scale, np.array(table), 12)
    tol = {"fp32": 0, "bf16": 2.0**-8, "fp8": 2.0**-3}[dtype]  # relative rounding of the format, with margin
    for pos in range(12):
        slot = table[pos // 4] * 4 + pos % 4
        if slot in slots:
            want = k[slots.index(slot)]
            np.testing.assert_allclose(got[pos], want, rtol=tol, atol=tol * np.abs(want).max())
        else:
            assert np.all(np.isnan(got[pos]))  # never written: poison, not a plausible number


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_kv_block_bytes_is_what_the_numpy_cache_allocates(dtype):
    """One block over all layers: K, V and (fp8) their scales; the NumPy cache keeps BF16 in float32."""
    config = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    num_blocks, block_size = 5, 4
    layers = allocate_kv_cache(3, num_blocks, 2, block_size, 16, dtype)
    arrays = [a for layer in layers for a in (layer.k, layer.v, layer.k_scale, layer.v_scale) if a is not None]
    nbytes = sum(a.nbytes for a in arrays)
    assert kv_block_bytes(config, block_size, dtype, numpy=True) * num_blocks == nbytes
    # the GPU cache: 1, 2 or 4 bytes per element, plus a float32 scale per (token, kv head) for fp8
    per_element = {"fp8": 1 + 4 / 16, "bf16": 2, "fp32": 4}[dtype]
    assert kv_block_bytes(config, block_size, dtype) == 3 * 2 * block_size * 2 * 16 * per_element
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_block_bytes(config, block_size, "int4")
