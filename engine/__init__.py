"""The Qwen3-FP8 engine: checkpoint I/O, tokenizer, model, paged KV cache, generation, command line.

For now it holds only the ``fp8lab`` command line (``engine.cli``); the model arrives with its issue.
"""
