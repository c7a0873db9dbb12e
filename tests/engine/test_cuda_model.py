"""``fp8lab.engine.cuda.model.CudaQwen3Model`` (the forward pass as ``numba_kernels``) against ``Qwen3Model`` on the
reference backend.

In the CUDA simulator (``cudasim``), on a micro model (1 to 2 layers, hidden 128, GQA 2:1, head_dim
64, FP8 blocks of 48 x 128 so that every fused weight is re-blocked and has partial edge blocks):
every non-GEMM kernel runs for real (embedding, norms, RoPE, cache write, split-kv decode with a
combine, prefill expansion, SwiGLU, the BF16 cast); the GEMM kernels (``gemv_simt`` in its three forms,
``fp8_gemm``, ``gemv_mma_swiglu``, ``bf16_linear`` and the tensor-core lm_head ``gemv_mma_bf16``) are replaced by
bit-exact NumPy twins (``helpers.cuda_twins``: their simulators), because the simulator spends 2 to 4
ms per simulated thread: one SIMT GEMV of 384 x 128 takes 15 s there, a micro-model forward minutes.
The twins check their arguments with ``fp8lab.numba_kernels.arguments.check_gemm`` like the kernels.

On a GPU (``gpu``): the embedded tiny model (``fp8lab.engine.tiny``) with the real kernels.

Bounds (``rel`` = ``||got - ref|| / ||ref||`` over all compared logits; NaN never passes):

- **float32 GEMM inputs** (``f32_max_rows``): the kernels compute the reference's float32 math in
  another order (chunked fma chains with per-block scale promotion instead of a BLAS dot product of
  the dequantized weight; float32 split-kv attention instead of float64): a few ulps per operator.
  A last-bit difference in K or V can flip one rounding of the cache format (one BF16 ulp, 2^-8, or
  one E4M3 step, 2^-3, of that element). Modelled on the CPU by perturbing every linear output of the
  reference by 3e-7 relative noise: the tiny model amplifies (4 layers, projections of std 0.1):
  3e-6 .. 1e-3 over 32 steps (BF16 and FP8 KV), argmax never changed. The micro model, measured in
  the simulator: 2e-7 (BF16 and FP8 KV, two seeds; no flip). Bounds: ``1e-4`` (micro, BF16 KV: room
  for a BF16 flip), ``1e-3`` (micro, FP8 KV: room for an E4M3 flip), ``5e-3`` (tiny, both).
- **BF16 GEMM inputs** (more than ``f32_max_rows`` rows): every activation entering an FP8 GEMM or the lm_head
  is rounded to BF16 (relative error <= 2^-9): measured 2.2e-3 (BF16 KV) and 9.3e-3 (FP8 KV, flips)
  on the micro model, bound ``2^-6`` (BF16 KV); on the tiny model (CPU model of the rounding) 1.0 ..
  1.2% with BF16 KV, bound ``5e-2``; no token identity is claimed there.
- Greedy tokens: identical. The GPU test's prompts were chosen where the reference's smallest top-2
  logit margin over the 32 steps is at least 0.017 (BF16 KV) / 0.022 (FP8 KV), about 20 times the
  worst logit difference above, and the test asserts those margins so a changed tiny model shows up
  as such rather than as a kernel bug.

Runtimes on a shared 2-core CPU (simulator): the two greedy tests about 15 s each, the BF16-input test
7 s, the ``generate --backend cudasim`` test 4 s, the rest well under a second: about 40 s in all.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cuda_twins import micro_config, micro_tensors
from helpers.engine import (
    float_config,
    rel_err,
    tiny_config,
)

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.engine.backend import ReferenceBackend
from fp8lab.engine.cuda import plan
from fp8lab.engine.cuda.model import CudaQwen3Model, decode_buckets, prefill_buckets
from fp8lab.engine.cuda.plan import decode_context_bound
from fp8lab.engine.cuda.weights import fuse_fp8_for_gemm, unsupported_reason
from fp8lab.engine.generate import Generator
from fp8lab.engine.kv_manager import KVCacheExhausted, KVCacheManager
from fp8lab.engine.loading import get_backend, load_model, resolve_backend
from fp8lab.engine.model import Qwen3Model, make_batch
from fp8lab.numba_kernels import prefill_mma, splitkv, splitkv_mma
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.reference import blockwise

MICRO_F32_BOUND = {"bf16": 1e-4, "fp8": 1e-3}
MICRO_BF16_INPUT_BOUND = 2.0**-6
TINY_F32_BOUND = 5e-3
TINY_BF16_INPUT_BOUND = 5e-2


# ---------------------------------------------------------------------------- the micro model


def run_greedy(model, prompts, steps: int, kv: str, num_blocks: int = 8, block_size: int = 4):
    """Prefill every prompt in one forward, then ``steps`` decode steps of all sequences (greedy).
    Returns ``(tokens [seq][step], logits [steps + 1, seqs, vocab], (manager, cache))``."""
    manager = KVCacheManager(num_blocks, block_size)
    cache = model.allocate_kv_cache(num_blocks, block_size, kv)
    for i in range(len(prompts)):
        manager.add_sequence(i)
    logits = [model.forward(make_batch(manager, list(enumerate(prompts))), cache)]
    tokens = [[int(t)] for t in logits[-1].argmax(axis=1)]
    for _ in range(steps):
        logits.append(model.forward(make_batch(manager, [(i, [toks[-1]]) for i, toks in enumerate(tokens)]), cache))
        for toks, t in zip(tokens, logits[-1].argmax(axis=1)):
            toks.append(int(t))
    return tokens, np.array(logits), (manager, cache)


def untouched_slots_are_poison(manager, cache) -> bool:
    """Every cache slot no sequence owns still holds the allocation's 0xFF poison (in K, V and scales)."""
    used = np.zeros(cache.num_blocks * cache.block_size, bool)
    for seq in manager.sequences:
        used[manager.slots(seq, np.arange(manager.context_len(seq)))] = True
    for layer in cache:
        scales = (layer.k_scale, layer.v_scale) if layer.kv_format.scaled else ()
        for array in (layer.k, layer.v, *scales):
            by_slot = np.moveaxis(array.view(np.uint8).reshape(*array.shape[:3], -1), 2, 1)
            by_slot = by_slot.reshape(cache.num_blocks * cache.block_size, -1)
            if not (np.all(by_slot[~used] == 0xFF) and np.all(np.any(by_slot[used] != 0xFF, axis=1))):
                return False
    return True


PROMPTS = [[5, 17, 200, 3], [7, 8], [250]]
"""Three sequences: one prefill of 7 tokens (the one-token prompt is a prefill row like the others), then
decode steps of 3 rows padded to the bucket of 4."""


@pytest.mark.cudasim
def test_a_batch_of_three_matches_the_reference_with_a_padding_row(gemm_twins):
    """FP8 KV; prefill of 3 sequences in one forward, one decode step of bucket 4 (slot -1, length 0 in
    the padding row), the first sequence's new token in its second block."""
    config = micro_config()
    tensors = micro_tensors(config)
    model = CudaQwen3Model(config, tensors, max_num_tokens=8, max_num_seqs=4, f32_max_rows=16)
    want_tokens, want, _ = run_greedy(Qwen3Model(config, tensors), PROMPTS, 1, "fp8")
    got_tokens, got, (manager, cache) = run_greedy(model, PROMPTS, 1, "fp8")
    assert got_tokens == want_tokens
    assert rel_err(got, want) <= MICRO_F32_BOUND["fp8"], rel_err(got, want)
    assert model.stats.decode_steps == 1 and model.stats.last_decode_bucket == 4 and model.stats.graph_replays == 0
    # more than one row: still one q/k/v GEMM (its column slices feed the next kernel); 2 splits: split + combine
    assert model.stats.launches_per_decode_step == 9 * config.num_hidden_layers + 4
    assert untouched_slots_are_poison(manager, cache)  # the padding row wrote nothing


@pytest.mark.cudasim
def test_one_sequence_through_two_layers_matches_the_reference(gemm_twins):
    """BF16 KV, 2 layers (the residual add fused into the next layer's norm), batch 1 (one fused q/k/v
    GEMM and one RoPE launch per layer); 2 decode steps, the second in the sequence's second block."""
    config = micro_config(layers=2)
    tensors = micro_tensors(config, seed=4)
    prompt = [[11, 22, 33, 44]]
    want_tokens, want, _ = run_greedy(Qwen3Model(config, tensors), prompt, 2, "bf16")
    model = CudaQwen3Model(config, tensors, max_num_tokens=4, max_num_seqs=1, f32_max_rows=16)
    got_tokens, got, (manager, cache) = run_greedy(model, prompt, 2, "bf16")
    assert got_tokens == want_tokens
    assert rel_err(got, want) <= MICRO_F32_BOUND["bf16"], rel_err(got, want)
    assert model.stats.launches_per_decode_step == 9 * 2 + 4
    assert untouched_slots_are_poison(manager, cache)
    # greedy sampling on the device: the same step twice (writing the same K/V into the same slot)
    step = make_batch(manager, [(0, [got_tokens[0][-1]])])
    ids = model.greedy_tokens(step, cache)
    logits = model.forward(step, cache)
    assert ids.tolist() == [int(np.argmax(logits[0]))]


def record_flash_prefill(monkeypatch) -> list:
    """The calls of ``prefill_mma.paged_prefill_mma``, which still run: ``([q, k_cache, v_cache, block_tables,
    context_lens, query_lens], softmax_scale, (k_scale, v_scale), out)``, copies taken as the call returns."""
    calls, real = [], prefill_mma.paged_prefill_mma

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        scales = tuple(None if x is None else np.array(x, copy=True) for x in args[8:10])
        calls.append(([np.array(x, copy=True) for x in args[:6]], args[6], scales, np.array(out, copy=True)))
        return out

    monkeypatch.setattr(prefill_mma, "paged_prefill_mma", recorded)
    return calls


@pytest.mark.cudasim
def test_decode_attention_over_an_fp8_cache_of_whole_tiles_runs_on_tensor_cores(gemm_twins, monkeypatch):
    """head_dim 128 and KV blocks of 16 (what ``splitkv_mma`` takes): a decode step of 2 sequences runs the
    tensor-core attention with its input (one launch: q/k-norm, RoPE, the cache write and the attention), whose
    output and cache writes are bit for bit ``fp8lab.simulators.splitkv_mma.decode_with_input`` on the very arrays
    the engine passed it (the step's q/k/v GEMM output, tables and the cache as it was before); the greedy tokens are
    the reference's and the logits within this micro model's FP8-cache error of it; a BF16 cache keeps the SIMT
    kernel and its separate attention input. The prompts' prefill runs the tensor-core flash prefill, bit for bit
    ``fp8lab.simulators.prefill_mma`` on the arrays the engine passed it."""
    from fp8lab.simulators import prefill_mma as prefill_model
    from fp8lab.simulators import splitkv_mma as model

    prefill_calls = record_flash_prefill(monkeypatch)
    calls = []
    real = splitkv_mma.decode_mma_with_input
    cache_arguments = (8, 9, 14, 15)  # k_cache, v_cache, k_scale, v_scale

    def recorded(*args, **kwargs):
        before = [np.array(args[i], copy=True) for i in cache_arguments]
        inputs = [np.array(x, copy=True) for x in args[:3]]
        out = real(*args, **kwargs)
        after = [np.array(args[i], copy=True) for i in cache_arguments]
        calls.append((args, inputs, kwargs, before, after, np.array(out, copy=True)))
        return out

    monkeypatch.setattr(splitkv_mma, "decode_mma_with_input", recorded)
    config = micro_config(head_dim=128)
    tensors = micro_tensors(config, seed=6)
    want_tokens, want, _ = run_greedy(Qwen3Model(config, tensors), PROMPTS[:2], 1, "fp8", num_blocks=4, block_size=16)
    model_ = CudaQwen3Model(config, tensors, max_num_tokens=8, max_num_seqs=2, f32_max_rows=16)
    bf16_plan = model_.planner.decode(2, model_.allocate_kv_cache(4, 16, "bf16"), 512)
    assert splitkv_mma.decode_mma_with_input not in [launch.kernel for launch in bf16_plan.launches]
    got_tokens, got, _ = run_greedy(model_, PROMPTS[:2], 1, "fp8", num_blocks=4, block_size=16)
    assert len(calls) == config.num_hidden_layers and got_tokens == want_tokens  # one decode step, every layer
    assert len(prefill_calls) == config.num_hidden_layers  # one prefill forward, every layer
    (q_, k_cache, v_cache, tables_, context_lens, query_lens), scale_, (k_scale, v_scale), out_ = prefill_calls[0]
    real = int(np.sum(query_lens))  # the prompts' rows; the rest pad the forward to its token bucket
    assert real == 6 and q_.shape[0] == 8
    assert np.array_equal(out_[:real], prefill_model.paged_prefill(q_, k_cache, v_cache, tables_, context_lens,
                                                                   query_lens, scale_, k_scale, v_scale)[:real])
    args, (q, k, v), kwargs, before, after, out = calls[0]
    q_norm, k_norm, eps, positions, cos_sin, tables, lens, scale = args[3:8] + args[10:13]
    expected = model.decode_with_input(q, k, v, q_norm, k_norm, eps, np.asarray(positions), np.asarray(cos_sin),
                                       before[0], before[1], np.asarray(tables), np.asarray(lens), scale, before[2],
                                       before[3], num_splits=kwargs["num_splits"])
    assert np.array_equal(out, expected)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(after, before))  # simulated write
    assert rel_err(got, want) <= 1e-2, rel_err(got, want)  # the FP8 cache's error at head_dim 128 (about 4e-3)


@pytest.mark.cudasim
def test_prefill_over_a_bf16_cache_of_whole_tiles_runs_the_flash_prefill(gemm_twins, monkeypatch):
    """head_dim 128, a BF16 cache of 16-token blocks: the prompts' prefill runs the tensor-core flash prefill in every
    layer (BF16 operands), bit for bit ``fp8lab.simulators.prefill_mma`` on the arrays the engine passed it; the
    greedy tokens are the reference's and the logits within 5e-3 of it (the BF16 query and weights; measured 4e-4)."""
    from fp8lab.simulators import prefill_mma as prefill_model

    calls = record_flash_prefill(monkeypatch)
    config = micro_config(head_dim=128)
    tensors = micro_tensors(config, seed=7)
    want_tokens, want, _ = run_greedy(Qwen3Model(config, tensors), PROMPTS[:2], 0, "bf16", num_blocks=4, block_size=16)
    model = CudaQwen3Model(config, tensors, max_num_tokens=8, max_num_seqs=2, f32_max_rows=16)
    got_tokens, got, _ = run_greedy(model, PROMPTS[:2], 0, "bf16", num_blocks=4, block_size=16)
    assert len(calls) == config.num_hidden_layers and got_tokens == want_tokens
    (q, k_cache, v_cache, tables, context_lens, query_lens), scale, scales, out = calls[0]
    assert k_cache.dtype == np.uint16 and scales == (None, None)
    real = int(np.sum(query_lens))  # the prompts' rows; the rest pad the forward to its token bucket
    assert np.array_equal(out[:real], prefill_model.paged_prefill(q, k_cache, v_cache, tables, context_lens,
                                                                  query_lens, scale, None, None)[:real])
    assert rel_err(got, want) <= 5e-3, rel_err(got, want)


@pytest.mark.cudasim
def test_a_decode_batch_feeds_the_tensor_core_lm_head_bf16_from_the_final_norm(gemm_twins, monkeypatch):
    """The default ``f32_max_rows`` (1) on a batch of three: the prefill's lm_head takes its 3 float32 last-token rows
    (rounded to BF16 on load), each decode step's (bucket 4) the final norm's BF16 bits, on ``gemv_mma_bf16``; the
    logits within the BF16-input bound of the reference that rounds every GEMM input, the lm_head's included
    (``ReferenceBackend(gemm_input="bf16")``), the greedy tokens identical."""
    config = micro_config()
    tensors = micro_tensors(config)
    model = CudaQwen3Model(config, tensors, max_num_tokens=8, max_num_seqs=4)
    assert model.f32_max_rows == 1
    lm_head_twin, inputs = plan.gemv_mma_bf16, []
    monkeypatch.setattr(plan, "gemv_mma_bf16",
                        lambda a, *args, **kwargs: inputs.append((a.shape[0], a.dtype)) or lm_head_twin(a, *args, **kwargs))
    reference = Qwen3Model(config, tensors, ReferenceBackend(gemm_input="bf16"))
    # blocks of 8: one per sequence, one split (few simulated CTAs; the combine is the other tests')
    want_tokens, want, _ = run_greedy(reference, PROMPTS, 2, "bf16", num_blocks=4, block_size=8)
    got_tokens, got, _ = run_greedy(model, PROMPTS, 2, "bf16", num_blocks=4, block_size=8)
    assert got_tokens == want_tokens
    assert 0 < rel_err(got, want) <= MICRO_BF16_INPUT_BOUND, rel_err(got, want)
    assert inputs == [(3, np.float32), (4, np.uint16), (4, np.uint16)]


@pytest.mark.cudasim
@pytest.mark.parametrize("prompts, gemm", [(PROMPTS, "gemv_mma"),
                                           (PROMPTS + [list(range(9, 17)), list(range(20, 28)), list(range(30, 38)),
                                                       [17, 18]], "gemm_mma")])
def test_bf16_gemm_inputs_and_all_logits(gemm_twins, monkeypatch, prompts, gemm):
    """A prefill longer than ``f32_max_rows``: the norms, attention and SwiGLU write their GEMM's input as BF16 bits
    (no ``bf16_round`` launch), read by the twins of the tensor-core GEMV (7 rows: ``fp8_gemm`` picks
    ``gemv_mma``, the gate/up launch is ``gemv_mma_swiglu``) or of the tensor-core GEMM (33 rows, past ``gemv_mma``'s
    32: ``gemm_mma``, then ``silu_mul``); every token's logits, computed in chunks of ``max_num_seqs`` rows."""
    config = micro_config(head_dim=128)  # the flash prefill over the BF16 cache: few simulated CTAs
    tensors = micro_tensors(config, seed=5)
    reference = Qwen3Model(config, tensors)
    model = CudaQwen3Model(config, tensors, max_num_tokens=40, max_num_seqs=7, f32_max_rows=4)
    swiglu_twin, lm_head_twin, calls, lm_head_rows = plan.gemv_mma_swiglu, plan.gemv_mma_bf16, [], []
    monkeypatch.setattr(plan, "gemv_mma_swiglu", lambda *args, **kwargs: calls.append(1) or swiglu_twin(*args, **kwargs))
    monkeypatch.setattr(plan, "gemv_mma_bf16",
                        lambda a, *args, **kwargs: lm_head_rows.append(a.shape[0]) or lm_head_twin(a, *args, **kwargs))
    monkeypatch.setattr(plan.layers, "bf16_round", None)  # a rounding launch would fail: the producers round
    logits = []
    for m in (reference, model):
        manager = KVCacheManager(8, 16)
        cache = m.allocate_kv_cache(8, 16, "bf16")
        for i in range(len(prompts)):  # at most 8 blocks of 16 tokens (one each)
            manager.add_sequence(i)
        logits.append(m.forward(make_batch(manager, list(enumerate(prompts))), cache, all_logits=True))
    want, got = logits
    rows = sum(map(len, prompts))
    assert got.shape == (rows, config.vocab_size)
    assert 1e-5 < rel_err(got, want) <= MICRO_BF16_INPUT_BOUND, rel_err(got, want)  # it did round to BF16
    assert len(calls) == (config.num_hidden_layers if gemm == "gemv_mma" else 0)  # which tensor-core kernel ran
    chunks = [min(7, rows - first) for first in range(0, rows, 7)]  # max_num_seqs rows at a time
    assert lm_head_rows == [c for c in chunks if c > 4]  # on tensor cores past f32_max_rows


# ---------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def small_model():
    config = micro_config(layers=1)
    return CudaQwen3Model(config, micro_tensors(config), max_num_tokens=8, max_num_seqs=2)


def test_a_batch_larger_than_the_buffers_is_a_value_error(small_model):
    manager = KVCacheManager(8, 4)
    cache = small_model.allocate_kv_cache(8, 4, "fp8")
    for i in range(3):
        manager.add_sequence(i)
    with pytest.raises(ValueError, match="max_num_tokens=8"):
        small_model.forward(make_batch(manager, [(0, list(range(9)))]), cache)  # 9 > 8 positions too: tokens first
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        small_model.forward(make_batch(manager, [(0, [1]), (1, [2]), (2, [3])]), cache)


@pytest.mark.cudasim
def test_a_batch_the_cache_cannot_take_is_a_value_error(small_model, gemm_twins):
    """Each of the model's batch checks, on a decode batch wrong in one field only; the good batch runs (its GEMMs
    as their NumPy twins, the rest in the CUDA simulator)."""
    from dataclasses import replace

    cache = small_model.allocate_kv_cache(8, 4, "fp8")
    manager = KVCacheManager(8, 4)
    for i in range(2):
        manager.add_sequence(i)
    good = make_batch(manager, [(0, [6]), (1, [7])])  # each sequence's first token, as a decode step
    vocab, positions = small_model.config.vocab_size, small_model.config.max_position_embeddings
    bad = [(dict(token_ids=np.array([6, vocab])), "token ids must lie in"),
           (dict(token_ids=np.array([-1, 7])), "token ids must lie in"),
           (dict(positions=np.array([0, positions])), "positions must lie in"),
           (dict(slot_mapping=np.array([0, 0])), "slots must be distinct"),
           (dict(slot_mapping=np.array([0, 32])), r"slots must be distinct and lie in \[0, 32\)"),
           (dict(slot_mapping=np.array([-1, 5])), "slots must be distinct and lie in"),
           (dict(slot_mapping=good.slot_mapping[::-1].copy()), "position context_len - 1"),
           (dict(context_lens=np.array([1, 9])), "block_tables: at most"),
           (dict(query_lens=np.array([1, 0])), "query_lens"),
           (dict(positions=np.array([0])), "one entry per token")]
    for fields, message in bad:
        for run in (small_model.forward, small_model.greedy_tokens):
            with pytest.raises(ValueError, match=message):
                run(replace(good, **fields), cache)
    assert small_model.greedy_tokens(good, cache).shape == (2,)


def test_kv_exhaustion_surfaces_through_the_generator(small_model):
    generator = Generator(small_model, None, kv_format="fp8", block_size=4, num_blocks=1, stop_token_ids=())
    with pytest.raises(KVCacheExhausted, match="2 blocks needed, 1 free"):
        generator.generate([[1, 2, 3]], max_new_tokens=3)


def test_out_of_memory_names_what_did_not_fit(small_model):
    with pytest.raises(RuntimeError, match=r"KV cache layer 0 K .* needs [\d,]+ bytes"):
        small_model.allocate_kv_cache(2**44, 8, "fp8")


def test_unsupported_shapes_and_foreign_caches_are_refused(small_model):
    assert "multiple of 128" in unsupported_reason(tiny_config(head_dim=64))
    assert "head_dim 16" in unsupported_reason(tiny_config())
    with pytest.raises(ValueError, match="unsupported model"):
        CudaQwen3Model(tiny_config(), {})
    reference = Qwen3Model(small_model.config, micro_tensors(small_model.config))
    manager = KVCacheManager(4, 4)
    manager.add_sequence(0)
    with pytest.raises(ValueError, match="allocate_kv_cache"):
        small_model.forward(make_batch(manager, [(0, [1, 2])]), reference.allocate_kv_cache(4, 4, "fp8"))


# ---------------------------------------------------------------------------- host-side pieces


def test_fp8_weights_fuse_only_into_blocks_the_tensor_core_gemm_takes():
    """``fuse_fp8_for_gemm`` is ``blockwise.concatenate_rows`` (tested in ``tests/reference/test_blockwise.py``)
    when the re-blocked block_n is a multiple of 8: rows 128 + 64 + 64 in blocks of 48 -> 16; else None."""
    rng = np.random.default_rng(0)
    block = (48, 128)
    parts = [blockwise.quantize(rng.standard_normal((n, 256)).astype(np.float32), block) for n in (128, 64, 64)]
    codes, scales, new_block = fuse_fp8_for_gemm(parts, block)
    assert new_block == (16, 128) and scales.shape == (16, 2)
    for got, want in zip((codes, scales, new_block), blockwise.concatenate_rows(parts, block)):
        np.testing.assert_array_equal(got, want)
    assert fuse_fp8_for_gemm([parts[0], (parts[1][0][:60], parts[1][1])], block) is None  # gcd 4: no multiple of 8


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_buckets(12) == (1, 2, 4, 8, 12)


def test_prefill_buckets():
    assert prefill_buckets(8) == (1, 2, 4, 8)
    assert prefill_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert prefill_buckets(2048)[7:] == tuple(range(128, 2049, 128))
    assert prefill_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)


@pytest.mark.cudasim
def test_padding_a_prefill_changes_no_real_row(gemm_twins):
    """head_dim 128 (the tensor-core prefill attention): three prompts of 7 tokens padded to a bucket of 8 tokens and 4
    sequences, and to one of 16 tokens: the logits bit for bit the same, the cache bytes too, and no slot but the
    prompts' written (padding tokens have slot -1)."""
    config = micro_config(head_dim=128)
    tensors = micro_tensors(config, seed=8)
    results = []
    for buckets in ((8, 16), (16,)):
        model = CudaQwen3Model(config, tensors, max_num_tokens=16, max_num_seqs=4)
        model.prefill_buckets = buckets
        _, logits, (manager, cache) = run_greedy(model, PROMPTS, 0, "fp8", num_blocks=4, block_size=16)
        assert untouched_slots_are_poison(manager, cache)
        results.append((logits, [np.asarray(a).copy() for layer in cache for a in (layer.k, layer.v, layer.k_scale)]))
    (a, cache_a), (b, cache_b) = results
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(cache_a, cache_b))


def test_decode_context_bound():
    assert [decode_context_bound(n, 40960) for n in (0, 1, 512, 513, 1024, 5000)] == [512, 512, 512, 1024, 1024, 8192]
    assert decode_context_bound(5000, 4096) == 4096 and decode_context_bound(3, 100) == 100  # at most the capacity


def test_a_decode_plan_is_made_for_its_context_bound_not_the_cache():
    """A short context in a large cache: attention is planned for the bound (its split count, its
    ``max_seq_len``), not for the cache's capacity, whose plan would differ."""
    config = micro_config(layers=1, max_position_embeddings=16384)
    model = CudaQwen3Model(config, micro_tensors(config), max_num_tokens=8, max_num_seqs=2)
    cache = model.allocate_kv_cache(512, 16, "fp8")
    sms = splitkv.device_num_sms()
    heads = (config.num_attention_heads, config.num_key_value_heads)
    bound = decode_context_bound(20, cache.capacity)
    assert bound == 512 < cache.capacity
    attention = [launch for launch in model.planner.decode(1, cache, bound).launches
                 if launch.label == "attention"]
    expected = splitkv.choose_num_splits(1, *heads, bound, sms, 16)
    assert expected != splitkv.choose_num_splits(1, *heads, cache.capacity, sms, 16)
    assert [(a.options["num_splits"], a.options["max_seq_len"]) for a in attention] == [(expected, bound)]


@pytest.mark.parametrize("vocab, tensor_cores", [(272, True), (264, False)])
def test_the_lm_head_takes_the_tensor_cores_past_f32_max_rows_where_its_shape_allows(vocab, tensor_cores):
    """``Planner.lm_head``: float32 ``bf16_linear`` up to ``f32_max_rows`` rows; beyond, ``tensor_core_lm_head`` (one
    ``gemv_mma_bf16`` launch per 16 float32 rows, per 32 BF16 rows) when the vocabulary is a multiple of 16, else
    ``bf16_linear`` still; a decode step's final norm writes BF16 exactly when the lm_head reads it."""
    config = micro_config(vocab_size=vocab)
    model = CudaQwen3Model(config, micro_tensors(config), max_num_tokens=40, max_num_seqs=40, f32_max_rows=2)
    planner, x = model.planner, model.activations.x
    assert planner.lm_head(x[:2], 2).kernel is plan.bf16_linear
    wide = planner.lm_head(x[:33], 33)
    assert wide.kernel is (plan.tensor_core_lm_head if tensor_cores else plan.bf16_linear)
    assert wide.kernels == (3 if tensor_cores else 1)  # 16 + 16 + 1 float32 rows
    if tensor_cores:
        assert planner.lm_head(planner.lm_head_input(x[:33]), 33).kernels == 2  # 32 + 1 BF16 rows
    assert (planner.lm_head_input(x[:4]).dtype == np.uint16) == tensor_cores
    cache = model.allocate_kv_cache(8, 4, "fp8")
    final_norm = next(launch for launch in planner.decode(4, cache, 8).launches if launch.label == "final norm")
    assert (final_norm.args[-1].dtype == np.uint16) == tensor_cores


def test_backend_selection_without_a_gpu():
    if SIMULATOR is False:
        pytest.skip("this process drives a GPU")
    assert resolve_backend("auto") == "reference"
    assert resolve_backend("cudasim") == "cudasim"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("tpu")
    with pytest.raises(ValueError, match="CudaQwen3Model"):
        get_backend("cuda")
    config = float_config(micro_config(layers=1))
    checkpoint = type("Checkpoint", (), {"config": config, "tensors": micro_tensors(config)})
    assert isinstance(load_model(checkpoint, "auto"), Qwen3Model)
    with pytest.raises(RuntimeError, match="sees no NVIDIA GPU"):
        load_model(checkpoint, "cuda")
    assert isinstance(load_model(checkpoint, "cudasim", max_num_tokens=4, max_num_seqs=1), CudaQwen3Model)


@pytest.mark.cudasim
def test_fp8lab_generate_backend_cudasim(gemm_twins, monkeypatch, tmp_path, capsys):
    """``fp8lab generate --backend cudasim`` on the micro model (fake checkpoint and byte tokenizer modules,
    as in ``tests/engine/test_generate.py``): a 2-token prompt, one decode step."""
    import sys
    import types

    from helpers.engine import FakeStreamDecoder, FakeTokenizer

    import fp8lab.engine.tiny  # noqa: F401  (imported now: it imports from the real checkpoint module, faked below)
    from fp8lab import cli

    config = micro_config()
    tensors = micro_tensors(config)
    (tmp_path / "config.json").write_text("{}")
    checkpoint = types.SimpleNamespace(path=tmp_path, config=config, tensors=tensors, stored_dtypes={},
                                       generation_config={"eos_token_id": 256})

    class Tokenizer(FakeTokenizer):
        @classmethod
        def from_dir(cls, path):
            return cls()

    for name, attrs in {"fp8lab.engine.checkpoint": {"load_checkpoint": lambda path: checkpoint},
                        "fp8lab.engine.tokenizer": {"Tokenizer": Tokenizer, "StreamDecoder": FakeStreamDecoder}}.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    argv = ["generate", "--model", str(tmp_path), "--backend", "cudasim", "--prompt", "hi", "--max-new-tokens", "2",
            "--block-size", "4"]
    assert cli.main(argv) == 0
    want = Generator(Qwen3Model(config, tensors), Tokenizer(), kv_format="fp8", block_size=4,
                     stream_decoder=FakeStreamDecoder).generate(["hi"], max_new_tokens=2).results[0]
    out, err = capsys.readouterr()
    assert "backend cudasim" in err and "prompt: 2 tokens" in err
    assert out == want.text + "\n"


# ---------------------------------------------------------------------------- on a GPU: the embedded tiny model

GPU_PROMPTS = ("In the beginning", "Once upon a time")
GPU_MIN_MARGIN = {"bf16": 0.015, "fp8": 0.02}
GPU_STEPS = 32


@pytest.fixture(scope="module")
def tiny():
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.tiny import default_model_dir
    from fp8lab.engine.tokenizer import Tokenizer

    directory = default_model_dir(fp8=True)
    return load_checkpoint(directory), Tokenizer.from_dir(directory)


def greedy_one(model, prompt, kv, steps=GPU_STEPS):
    tokens, logits, _ = run_greedy(model, [prompt], steps - 1, kv, num_blocks=16, block_size=16)
    return tokens[0], logits[:, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_greedy_tokens_match_the_reference(tiny, kv):
    checkpoint, tokenizer = tiny
    reference = Qwen3Model.from_checkpoint(checkpoint)
    model = CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=64, max_num_seqs=2, f32_max_rows=16)
    for text in GPU_PROMPTS:
        prompt = tokenizer.encode(text)
        assert len(prompt) <= model.f32_max_rows  # float32 GEMM inputs all the way
        want_tokens, want = greedy_one(reference, prompt, kv)
        top2 = np.sort(want, axis=1)[:, -2:]
        assert np.min(top2[:, 1] - top2[:, 0]) >= GPU_MIN_MARGIN[kv], "the tiny model changed: pick other prompts"
        got_tokens, got = greedy_one(model, prompt, kv)
        assert got_tokens == want_tokens, text
        assert rel_err(got, want) <= TINY_F32_BOUND, (text, rel_err(got, want))
    stats = model.stats
    print(f"\n[{kv}] {stats.as_dict()}")
    assert stats.graphs_captured >= 1 and stats.graph_replays >= GPU_STEPS - 3
    assert stats.launches_per_decode_step == 4 * 9 + 4


@pytest.mark.gpu
def test_gpu_batched_generation_matches_the_reference(tiny):
    """Two prompts through ``Generator`` (one prefill, decode steps of bucket 2), BF16 and FP8 KV."""
    checkpoint, tokenizer = tiny
    reference = Qwen3Model.from_checkpoint(checkpoint)
    model = CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=64, max_num_seqs=2, f32_max_rows=16)
    for kv in ("bf16", "fp8"):
        outputs = [Generator(m, tokenizer, kv_format=kv, stop_token_ids=()).generate(
            list(GPU_PROMPTS), max_new_tokens=GPU_STEPS) for m in (reference, model)]
        assert [r.token_ids for r in outputs[1].results] == [r.token_ids for r in outputs[0].results], kv


@pytest.mark.gpu
def test_gpu_graph_replay_is_bit_identical_to_eager_steps(tiny):
    checkpoint, tokenizer = tiny
    prompt = tokenizer.encode(GPU_PROMPTS[0])
    graphs = CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=64, max_num_seqs=1, f32_max_rows=16)
    eager = CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=64, max_num_seqs=1, f32_max_rows=16,
                                           cuda_graphs=False)
    for kv in ("bf16", "fp8"):
        got_tokens, got = greedy_one(graphs, prompt, kv, steps=12)
        want_tokens, want = greedy_one(eager, prompt, kv, steps=12)
        assert got_tokens == want_tokens
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert graphs.stats.graph_replays >= 2 * 9 and eager.stats.graph_replays == 0
    print(f"\ngraphs: {graphs.stats.as_dict()}\neager: {eager.stats.as_dict()}")


def stepped_logits(model, prompts, schedule, kv):
    """Prefill ``prompts``, then one decode step per entry of ``schedule`` (the sequences that step runs, by
    index: batches that shrink reuse a larger bucket's graph with padding rows); every step's logits."""
    manager = KVCacheManager(32, 16)
    cache = model.allocate_kv_cache(32, 16, kv)
    for i in range(len(prompts)):
        manager.add_sequence(i)
    logits = model.forward(make_batch(manager, list(enumerate(prompts))), cache)
    tokens = {i: int(np.argmax(row)) for i, row in enumerate(logits)}
    out = []
    for active in schedule:
        step = model.forward(make_batch(manager, [(i, [tokens[i]]) for i in active]), cache)
        tokens.update((i, int(np.argmax(row))) for i, row in zip(active, step))
        out.append(step)
    return out


@pytest.mark.gpu
def test_gpu_graphs_replayed_after_a_smaller_batch_are_eager_steps(tiny):
    """A bucket's graph captured at 4 sequences, replayed at 3 (a padding row where a sequence was) and a
    smaller bucket after it: every step's logits bit for bit the eager model's."""
    checkpoint, tokenizer = tiny
    prompts = [tokenizer.encode(p) for p in (*GPU_PROMPTS, "A third one", "and a fourth")]
    schedule = [[0, 1, 2, 3]] * 3 + [[0, 1, 3]] * 3 + [[2]] * 2
    options = dict(max_num_tokens=64, max_num_seqs=4, f32_max_rows=16)
    graphs = CudaQwen3Model.from_checkpoint(checkpoint, **options)
    eager = CudaQwen3Model.from_checkpoint(checkpoint, **options, cuda_graphs=False)
    for kv in ("bf16", "fp8"):
        for got, want in zip(stepped_logits(graphs, prompts, schedule, kv), stepped_logits(eager, prompts, schedule, kv)):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert graphs.stats.graph_replays >= 2 * 5 and eager.stats.graph_replays == 0


@pytest.mark.gpu
def test_gpu_graph_replay_at_the_qwen3_06b_shape_is_bit_identical_to_eager_steps():
    """The decode graph launches its kernels as programmatic dependent launches (``numba_kernels.pdl``: each
    starts before its predecessor ends and waits for it); eager steps are ordinary launches. At the tiny
    model's sizes most kernels are one wave; at the Qwen3-0.6B shape (4 of its layers, a random FP8
    checkpoint) the GEMVs, norms and split-kv kernels have their real grids. Every step's logits, batch 16 and 8
    (more than the default ``f32_max_rows``: BF16 inputs written by the norms, attention and SwiGLU, the tensor-core
    GEMV ``gemv_mma`` and its SwiGLU variant, on two batch tiles and on one), 4 and 1: bit for bit the eager
    model's, so no kernel read a buffer before its producer finished."""
    from fp8lab.engine import shapes

    checkpoint = shapes.random_checkpoint("qwen3-0.6b", seed=11, num_hidden_layers=4)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, checkpoint.config.vocab_size, n).tolist()
               for n in (9, 17, 5, 3, 8, 6, 4, 7, 2, 11, 5, 6, 3, 9, 4, 8)]
    schedule = [list(range(16))] * 2 + [list(range(8))] * 3 + [[0, 1, 2, 3]] * 3 + [[1]] * 3
    options = dict(max_num_tokens=128, max_num_seqs=16)
    graphs = CudaQwen3Model.from_checkpoint(checkpoint, **options)
    eager = CudaQwen3Model.from_checkpoint(checkpoint, **options, cuda_graphs=False)
    for kv in ("bf16", "fp8"):
        for got, want in zip(stepped_logits(graphs, prompts, schedule, kv), stepped_logits(eager, prompts, schedule, kv)):
            assert np.isfinite(want).all()
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert graphs.f32_max_rows < 8  # the default: batches 8 and 16 take the tensor-core path
    assert graphs.stats.graph_replays >= 2 * 6 and eager.stats.graph_replays == 0


@pytest.mark.gpu
def test_gpu_prefill_graph_replays_are_bit_identical_to_eager_prefills():
    """Over the tensor-core prefill attention a prefill is padded to its token and sequence buckets and, from its
    second run on, replayed as a CUDA graph. At the Qwen3-0.6B shape (4 layers, a random FP8 checkpoint), prompts of
    31, 30 and 25 tokens in 3, 4 and 2 sequences (buckets (32, 4), (32, 4), (32, 2)) and of 300 and 290 tokens (bucket
    (384, 1)), all in one cache: each prefill's logits bit for bit those of a model that never captures."""
    from fp8lab.engine import shapes

    checkpoint = shapes.random_checkpoint("qwen3-0.6b", seed=12, num_hidden_layers=4)
    rng = np.random.default_rng(12)
    batches = [(9, 17, 5), (10, 12, 6, 2), (20, 5), (300,), (290,)]
    options = dict(max_num_tokens=512, max_num_seqs=4)
    graphs = CudaQwen3Model.from_checkpoint(checkpoint, **options)
    eager = CudaQwen3Model.from_checkpoint(checkpoint, **options, cuda_graphs=False)
    for kv in ("bf16", "fp8"):
        runs = []
        for model in (graphs, eager):
            manager = KVCacheManager(64, 16)
            cache = model.allocate_kv_cache(64, 16, kv)
            logits, seq = [], 0
            for lengths in batches:
                prompts = [(seq + i, rng.integers(0, checkpoint.config.vocab_size, n).tolist())
                           for i, n in enumerate(lengths)]
                for s, _ in prompts:
                    manager.add_sequence(s)
                logits.append(model.forward(make_batch(manager, prompts), cache))
                for s, _ in prompts:
                    manager.free(s)
                seq += len(lengths)
            runs.append(logits)
            rng = np.random.default_rng(12)  # the same prompts for the eager model
        for got, want in zip(*runs):
            assert np.isfinite(want).all()
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert graphs.stats.prefill_graph_replays == 2 * 2 and eager.stats.prefill_graph_replays == 0


@pytest.mark.gpu
def test_gpu_long_prompt_takes_bf16_gemm_inputs(tiny):
    """A 40-token prompt (more than ``f32_max_rows``): tensor-core GEMMs on BF16 activations."""
    checkpoint, tokenizer = tiny
    prompt = tokenizer.encode("The engine runs on a GPU. " * 6)[:40]
    assert len(prompt) == 40
    logits = []
    for m in (Qwen3Model.from_checkpoint(checkpoint), CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=64)):
        manager = KVCacheManager(8, 16)
        manager.add_sequence(0)
        logits.append(m.forward(make_batch(manager, [(0, prompt)]), m.allocate_kv_cache(8, 16, "bf16"), all_logits=True))
    assert rel_err(logits[1], logits[0]) <= TINY_BF16_INPUT_BOUND, rel_err(logits[1], logits[0])


@pytest.mark.gpu
def test_gpu_out_of_memory_is_a_clear_error(tiny):
    model = CudaQwen3Model.from_checkpoint(tiny[0], max_num_tokens=16, max_num_seqs=1)
    with pytest.raises(RuntimeError, match=r"out of GPU memory: KV cache layer 0 K .* needs [\d,]+ bytes"):
        model.allocate_kv_cache(2**34, 16, "bf16")  # 2^34 blocks of 2 x 16 x 64 BF16: 64 TiB
    cache = model.allocate_kv_cache(4, 16, "bf16")  # the device still works afterwards
    assert len(cache) == 4


@pytest.mark.gpu
def test_gpu_fp8lab_generate_backend_cuda(capsys):
    from fp8lab import cli

    assert cli.main(["generate", "--backend", "cuda", "--prompt", "Hello", "--prompt", "Once upon a time",
                     "--max-new-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    assert "=== [0]" in out and "=== [1]" in out and "backend cuda" in err and "tokens/s" in err


# ---------------------------------------------------------------------------- on a GPU: the trained demo model

DEMO_NEAR_TIE = 1e-2
"""A greedy step whose reference top-2 logits are closer than this may legitimately flip under
another summation order; the comparison stops at the first such step."""


def tokens_until_near_tie(tokens: list[int], logits: np.ndarray) -> list[int]:
    """``tokens`` cut before the first step whose reference logits have a top-2 gap below ``DEMO_NEAR_TIE``."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    near = np.flatnonzero(top2[:, 1] - top2[:, 0] < DEMO_NEAR_TIE)
    return tokens[: near[0]] if len(near) else tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_demo_model_matches_the_reference(kv):
    """The shipped demo model, FP8 weights (``fp8lab generate``'s default model) on the GPU with the engine's
    defaults: a 96-token held-out prefill (BF16 GEMM inputs, tensor cores) within the BF16-input bound
    of the reference's float32 logits, and 32 greedy tokens from three held-out prompts identical to
    the reference's up to the first near tie (at least 16 tokens compared per prompt)."""
    from fp8lab.engine import demo
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.tokenizer import Tokenizer

    checkpoint = load_checkpoint(demo.default_model_dir(fp8=True), progress=False)
    ids = Tokenizer.from_dir(demo.DEMO_DIR).encode(demo.HELDOUT_TEXT.read_text(encoding="utf-8")[:40_000])
    reference = Qwen3Model.from_checkpoint(checkpoint)
    model = CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=128, max_num_seqs=1)
    logits = []
    for m in (reference, model):
        manager = KVCacheManager(8, 16)
        manager.add_sequence(0)
        logits.append(m.forward(make_batch(manager, [(0, ids[:96])]), m.allocate_kv_cache(8, 16, kv), all_logits=True))
    assert rel_err(logits[1], logits[0]) <= TINY_BF16_INPUT_BOUND, rel_err(logits[1], logits[0])
    for start in (400, 1000, 4000):
        prompt = ids[start : start + 12]
        want_tokens, want = greedy_one(reference, prompt, kv)
        got_tokens, _ = greedy_one(model, prompt, kv)
        compared = tokens_until_near_tie(want_tokens, want)
        print(f"\n[{kv}] prompt at {start}: {len(compared)} of {len(want_tokens)} tokens compared")
        assert len(compared) >= 16, "the demo model changed: pick other prompts"
        assert got_tokens[: len(compared)] == compared, start
