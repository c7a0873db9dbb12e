"""The independent oracle for the Qwen3 forward: transformers' ``Qwen3ForCausalLM`` in float32.

Skipped cleanly without torch and transformers (they are not fp8lab dependencies). A tiny
Qwen3 is built in transformers from the config fp8lab writes (``Qwen3Config.to_dict``) and the
same random tensors: for an FP8 model, transformers gets the dequantized weights
``decode(q) * scale_inv`` as float32, which are exactly the matrices our W8A16 linear uses.

Bound: ``||ours - theirs|| / ||theirs|| <= 1e-5`` over all logits. Both run in float32; they
differ in summation order, in the RoPE angles (float64 here, float32 there: about
``position * 2^-24`` radians) and in attention (float64 here, float32 there). Measured: about
3.5e-7.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers.engine import (
    FakeStreamDecoder,
    FakeTokenizer,
    dequantized_tensors,
    float_config,
    prefill_logits,
    random_model,
    rel_err,
    stepwise_logits,
    tiny_config,
)

from fp8lab.engine.generate import Generator
from fp8lab.engine.model import Qwen3Model

BOUND = 1e-5


def hf_model(config, float_tensors: dict[str, np.ndarray]):
    """``Qwen3ForCausalLM`` in float32 (eager attention) with our float tensors loaded."""
    hf_config = transformers.Qwen3Config(**float_config(config).to_dict())
    hf_config._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(hf_config).to(torch.float32).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in float_tensors.items()}, strict=False)
    # a tied lm_head is the embedding, not a tensor of its own
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("tie", [False, True])
def test_prefill_and_decode_logits_match_transformers(fp8, tie):
    config = tiny_config(fp8=fp8, tie=tie)
    ours, tensors = random_model(config, seed=21 + 2 * fp8 + tie)
    theirs = hf_model(config, dequantized_tensors(config, tensors) if fp8 else tensors)
    tokens = _tokens(5, 40)
    want = hf_logits(theirs, tokens)
    assert np.all(np.isfinite(want))
    assert rel_err(prefill_logits(ours, tokens), want) <= BOUND
    assert rel_err(stepwise_logits(ours, tokens, chunk_sizes=[17, 1, 1, 9, 1, 11]), want) <= BOUND


def test_greedy_generation_matches_transformers():
    config = tiny_config()
    ours, tensors = random_model(config, seed=30)
    theirs = hf_model(config, dequantized_tensors(config, tensors))
    prompt = _tokens(9, 12)
    tokens = list(prompt)
    for _ in range(12):  # plain greedy loop over transformers' full forward
        tokens.append(int(np.argmax(hf_logits(theirs, tokens)[-1])))
    gen = Generator(ours, FakeTokenizer(), kv_format="fp32", block_size=4, stop_token_ids=(),
                    stream_decoder=FakeStreamDecoder)
    (result,) = gen.generate([prompt], max_new_tokens=12).results
    assert result.token_ids == tokens[len(prompt):]


@pytest.mark.skipif(importlib.util.find_spec("fp8lab.engine.tiny") is None, reason="the checkpoint I/O half is not there yet")
def test_the_tiny_bf16_checkpoint_matches_transformers():
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.tiny import default_model_dir

    model_dir = default_model_dir(fp8=False)
    ours = Qwen3Model.from_checkpoint(load_checkpoint(model_dir))
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = _tokens(3, 32)
    tokens = [t % ours.config.vocab_size for t in tokens]
    assert rel_err(prefill_logits(ours, tokens), hf_logits(theirs, tokens)) <= BOUND


def test_the_demo_checkpoint_generates_transformers_greedy_tokens():
    """The shipped demo model (BF16): transformers' ``generate`` (greedy, float32, eager attention) and
    fp8lab's reference backend (float32 KV cache) produce the same 48 tokens from held-out prompts."""
    from fp8lab.engine import demo
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.tokenizer import Tokenizer

    ours = Qwen3Model.from_checkpoint(load_checkpoint(demo.DEMO_DIR, progress=False))
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(demo.DEMO_DIR, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tokenizer = Tokenizer.from_dir(demo.DEMO_DIR)
    text_ids = tokenizer.encode(demo.HELDOUT_TEXT.read_text(encoding="utf-8")[:20_000])
    prompts = [text_ids[start : start + 24] for start in (0, 1500, 3000)]
    gen = Generator(ours, tokenizer, kv_format="fp32", stop_token_ids=())
    results = gen.generate(prompts, max_new_tokens=48).results
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                                  min_new_tokens=48)
        assert result.token_ids == out[0, len(prompt):].tolist()
