"""Optional cross-check: transformers reads the tiny checkpoint as a real Qwen3 model.

Skipped cleanly when torch or transformers is missing. With them:

- ``Qwen3ForCausalLM.from_pretrained`` loads the BF16 tiny model with no missing, unexpected or
  mismatched keys, and its float32 logits match this suite's float64 Qwen3 forward pass
  (``tests/engine/test_tiny.py``) within a float32 bound;
- ``AutoTokenizer`` (Qwen2Tokenizer) and ``PreTrainedTokenizerFast`` load the tokenizer folder
  and encode, decode and apply the chat template exactly as ``fp8lab.engine.tokenizer`` does.

The FP8 variant is not tested: transformers 5.x asks for ``accelerate`` before it loads an FP8
checkpoint, and its FP8 path (W8A8 with dynamic activation scales) computes differently anyway.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers.engine import dense_forward64, dense_weights

from fp8lab.engine import checkpoint as ck
from fp8lab.engine.tiny import make_tiny
from fp8lab.engine.tokenizer import Tokenizer

TEXTS = [
    "The lighthouse keeper's café costs 12.50 € — naïve? 日本語 🙂",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "  leading spaces,\ttabs\n\n\nand 1234567890 digits  ",
    "e\u0301 is NFC-normalized to \u00e9",
]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("hf") / "bf16")


def test_qwen3_for_causal_lm_loads_and_agrees(bf16_dir):
    model, info = transformers.Qwen3ForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    ids = Tokenizer.from_dir(bf16_dir).encode("Numbers are a comfort on a quiet day.")
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    c = ck.load_checkpoint(bf16_dir, progress=False)
    ours = dense_forward64(c.config, dense_weights(c), ids)
    assert theirs.shape == ours.shape == (len(ids), 1024)
    assert np.linalg.norm(theirs - ours) / np.linalg.norm(ours) < 1e-4


def test_transformers_greedy_generation_varies(bf16_dir):
    model = transformers.Qwen3ForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(bf16_dir).encode("The lighthouse keeper")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    assert len(set(out)) >= 8, out


@pytest.mark.parametrize("loader", ["auto", "fast"])
def test_transformers_tokenizer_agrees(bf16_dir, loader):
    if loader == "auto":
        hf = transformers.AutoTokenizer.from_pretrained(bf16_dir)
    else:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bf16_dir / "tokenizer.json"))
    ours = Tokenizer.from_dir(bf16_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == ours.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)
    if loader == "auto":
        assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHello."},
            {"role": "user", "content": "Weather?"},
        ]
        for thinking in (True, False):
            theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
            assert theirs == ours.apply_chat_template(messages, enable_thinking=thinking)
