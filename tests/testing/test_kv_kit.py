"""The KV cache and attention checks of ``fp8lab.testing`` pass correct implementations: fp8lab's
oracle, hand-written token loops without a planted bug (``tests/helpers/zoo_kv.py``), and the
bit-exact simulator of fp8lab's split-kv decode kernel."""

from __future__ import annotations

from helpers.zoo_kv import my_decode, write_token_loop

from fp8lab import testing
from fp8lab.reference import kv_cache
from fp8lab.simulators import splitkv


def test_the_oracle_and_hand_written_loops_pass():
    testing.check_kv_quantize(kv_cache.quantize_kv)
    testing.check_paged_cache_write(write_token_loop)  # the loop without a planted bug
    testing.check_paged_cache_write(lambda *a: write_token_loop(*a, vllm_layout=True), layout="vllm")
    testing.check_paged_decode(lambda *a: my_decode(*a))  # the hand-written decode without a planted bug
    testing.check_paged_decode(lambda *a: my_decode(*a), fp8=False)


def test_the_split_kv_simulator_passes():
    """The bit-exact model of fp8lab's split-kv decode kernel (auto splits, log2-domain combine)."""
    testing.check_paged_decode(lambda *a: splitkv.paged_decode(*a), max_examples=15)

