"""Pipelined greedy decode (``fp8lab.engine.cuda.pipeline``): a decode step enqueued with its token ids fed on
the device from the step before it (``CudaQwen3Model.submit_greedy(..., feed=...)``) computes what the same step
with the ids from the host computes, and ``ContinuousBatch`` chains such steps only where they are wanted.

In the CUDA simulator (the micro model of ``test_cuda_model.py``, its GEMMs as bit-exact NumPy twins) every
kernel runs synchronously, but the ids still travel only on the device: the argmax writes them into the
cache's decode index and the fed step leaves them there (the placeholders the host passes are other ids). On
a GPU (``gpu``) the same on the tiny model with CUDA graphs, where the host really runs ahead.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cuda_twins import micro_config, micro_tensors

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.engine.cuda.model import CudaQwen3Model
from fp8lab.engine.generate import ContinuousBatch, Generator
from fp8lab.engine.kv_manager import KVCacheManager
from fp8lab.engine.model import Qwen3Model, make_batch

PROMPTS = [[5, 17, 200], [7, 8], [250, 3, 9, 11]]


def cache_bits(cache) -> list[np.ndarray]:
    """Every K, V (and scale) array of the cache as host bytes."""
    out = []
    for layer in cache:
        for array in (layer.k, layer.v, layer.k_scale, layer.v_scale):
            if array is not None:
                host = array if isinstance(array, np.ndarray) else array.copy_to_host()
                out.append(np.array(host).view(np.uint8).copy())
    return out


def greedy_steps(model, prompts, steps: int, kv: str, fed: bool, num_blocks: int = 8, block_size: int = 4,
                 seed: int = 0):
    """Prefill, then ``steps`` greedy decode steps of every sequence: with host ids (``greedy_tokens``), or
    chained with ``submit_greedy`` and fed ids (host placeholders drawn at random from the vocabulary,
    never the real ones). Returns the ids of each step ``[steps + 1][seqs]`` and the cache's bytes."""
    rng = np.random.default_rng(seed)
    manager = KVCacheManager(num_blocks, block_size)
    cache = model.allocate_kv_cache(num_blocks, block_size, kv)
    for i in range(len(prompts)):
        manager.add_sequence(i)
    ids = [model.greedy_tokens(make_batch(manager, list(enumerate(prompts))), cache).tolist()]
    pending = None
    for n in range(steps):
        if not fed:
            ids.append(model.greedy_tokens(make_batch(manager, [(i, [t]) for i, t in enumerate(ids[-1])]), cache).tolist())
            continue
        if pending is None:
            pending = model.submit_greedy(make_batch(manager, [(i, [t]) for i, t in enumerate(ids[-1])]), cache)
        current, pending = pending, None
        if n + 1 < steps:
            placeholders = [(i, [int((t + 1 + rng.integers(0, 50)) % model.config.vocab_size)])
                            for i, t in enumerate(ids[-1])]
            pending = model.submit_greedy(make_batch(manager, placeholders), cache, feed=current)
        ids.append(current.tokens().tolist())
    return ids, cache_bits(cache)


@pytest.mark.cudasim
def test_fed_steps_compute_what_steps_with_host_ids_compute(gemm_twins):
    """Three sequences (bucket 4, a padding row), FP8 KV, 2 decode steps: the same ids every step and the same
    cache bytes, whether each step's ids came from the host or stayed on the device (the GPU test below
    also takes BF16 KV)."""
    config = micro_config()
    tensors = micro_tensors(config, seed=7)
    model = CudaQwen3Model(config, tensors, max_num_tokens=16, max_num_seqs=4, f32_max_rows=16)
    # one block of 8 per sequence: a small cache, so the decode plan's split count (and the simulated CTAs) stay few
    want_ids, want_cache = greedy_steps(model, PROMPTS, 2, "fp8", fed=False, num_blocks=3, block_size=8)
    got_ids, got_cache = greedy_steps(model, PROMPTS, 2, "fp8", fed=True, num_blocks=3, block_size=8)
    assert got_ids == want_ids
    for got, want in zip(got_cache, want_cache):
        np.testing.assert_array_equal(got, want)


def test_a_feed_must_be_the_last_step_of_the_cache_with_as_many_rows():
    config = micro_config()
    model = CudaQwen3Model(config, micro_tensors(config), max_num_tokens=8, max_num_seqs=2, f32_max_rows=16)
    model.planner.decode = lambda *args: _NoKernels()  # these checks come before any kernel
    cache, other = (model.allocate_kv_cache(8, 4, "fp8") for _ in range(2))
    manager = KVCacheManager(8, 4)
    for i in range(2):
        manager.add_sequence(i)
    first = model.submit_greedy(make_batch(manager, [(0, [1]), (1, [2])]), cache)
    second = model.submit_greedy(make_batch(manager, [(0, [1]), (1, [2])]), cache, feed=first)
    with pytest.raises(ValueError, match="feed: expected the last decode step submitted on this cache"):
        model.submit_greedy(make_batch(manager, [(0, [1]), (1, [2])]), cache, feed=first)  # second came after it
    with pytest.raises(ValueError, match="feed: expected the last decode step submitted on this cache"):
        model.submit_greedy(make_batch(manager, [(0, [1]), (1, [2])]), other, feed=second)  # another cache's
    with pytest.raises(ValueError, match="of as many sequences"):
        model.submit_greedy(make_batch(manager, [(0, [1])]), cache, feed=second)
    with pytest.raises(ValueError, match="submit_greedy: expected a decode step"):
        model.submit_greedy(make_batch(manager, [(0, [1, 2])]), cache)


class _NoKernels:
    """A decode plan that launches nothing (the feed checks need no kernel)."""

    kernel_launches = 0

    def run(self, stream) -> None:
        pass


class Recording:
    """A model's ``submit_greedy`` that records whether each step was fed."""

    def __init__(self, model):
        self.fed: list[bool] = []
        submit = model.submit_greedy

        def recorded(batch, cache, feed=None):
            self.fed.append(feed is not None)
            return submit(batch, cache, feed=feed)

        model.submit_greedy = recorded


@pytest.mark.cudasim
def test_the_generator_pipelines_and_stops_where_the_reference_does(gemm_twins):
    """Two requests with their own lengths, one stopped by a stop token mid-way: the same tokens and finish
    reasons as the reference model's generation, with fed steps in between (the stopped sequence's extra
    step dropped, the chain broken where a sequence reaches its length). Blocks of 16: a sequence's one block,
    one attention split (few simulated CTAs)."""
    config = micro_config(max_position_embeddings=12)
    tensors = micro_tensors(config, seed=9)
    prompts = PROMPTS[:2]
    reference, model = Qwen3Model(config, tensors), CudaQwen3Model(config, tensors, max_num_tokens=16, max_num_seqs=2,
                                                                      f32_max_rows=16)
    free_run = Generator(reference, None, kv_format="fp8", block_size=16, stop_token_ids=()).generate(
        prompts, max_new_tokens=5).results
    stop = free_run[0].token_ids[2]  # request 0 stops at its 3rd token (or earlier, where the token comes sooner)
    assert stop not in free_run[1].token_ids, "the micro model changed: pick another stop token"
    lengths = {0: 5, 1: 4}
    runs = []
    for m in (reference, model):
        generator = Generator(m, None, kv_format="fp8", block_size=16, stop_token_ids=(stop,))
        batch = ContinuousBatch(generator, 16)
        for i, prompt in enumerate(prompts):
            batch.add(i, prompt, lengths[i])
        recording = Recording(m) if m is model else None
        results = []
        while batch.busy:
            results += batch.step()
        runs.append((sorted((r.index, r.token_ids, r.finish_reason) for r in results), recording))
    (want, _), (got, recording) = runs
    assert got == want
    assert [r[2] for r in want] == ["stop", "length"]
    assert any(recording.fed) and not all(recording.fed)  # chained steps, and unchained ones where the rows changed


@pytest.mark.cudasim
def test_an_abort_while_a_step_is_enqueued_drops_its_row(gemm_twins):
    """Request 1 aborted while the step after the current one is already enqueued with it: its row is
    dropped, request 0 goes on exactly as when it runs alone."""
    config = micro_config(max_position_embeddings=12)
    tensors = micro_tensors(config, seed=10)
    model = CudaQwen3Model(config, tensors, max_num_tokens=16, max_num_seqs=4, f32_max_rows=16)
    generator = Generator(model, None, kv_format="fp8", block_size=16, stop_token_ids=())
    alone = Generator(Qwen3Model(config, tensors), None, kv_format="fp8", block_size=16, stop_token_ids=()).generate(
        [PROMPTS[0]], max_new_tokens=6).results[0]
    batch = ContinuousBatch(generator, 16)
    batch.add(0, PROMPTS[0], 6)
    batch.add(1, PROMPTS[1], 6)
    batch.step()  # the prefill of both
    batch.step()  # a decode step, with the next one enqueued behind it
    assert batch._pending is not None
    aborted = batch.abort(1)
    assert aborted.finish_reason == "abort"
    results = []
    while batch.busy:
        results += batch.step()
    assert [(r.index, r.token_ids, r.finish_reason) for r in results] == [(0, alone.token_ids, "length")]


# ---------------------------------------------------------------------------- on a GPU: the tiny model, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_fed_steps_compute_what_steps_with_host_ids_compute(kv):
    """The tiny model, 3 sequences (bucket 4), 24 steps replayed as CUDA graphs with the host running a step
    ahead: the same ids every step and the same cache bytes as steps with host ids, which are the
    reference model's greedy tokens."""
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.tiny import default_model_dir

    checkpoint = load_checkpoint(default_model_dir(fp8=True))
    prompts = [[1, 2, 3, 4, 5], [100, 7], [42, 43, 44]]
    model = CudaQwen3Model.from_checkpoint(checkpoint, max_num_tokens=64, max_num_seqs=4, f32_max_rows=16)
    want_ids, want_cache = greedy_steps(model, prompts, 24, kv, fed=False, num_blocks=16, block_size=16)
    got_ids, got_cache = greedy_steps(model, prompts, 24, kv, fed=True, num_blocks=16, block_size=16)
    assert got_ids == want_ids
    for got, want in zip(got_cache, want_cache):
        np.testing.assert_array_equal(got, want)
    assert model.stats.graph_replays >= 40
