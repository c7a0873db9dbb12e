"""The Qwen3-FP8 engine: checkpoint I/O, tokenizer, model, paged KV cache, generation, command line.

Read in this order: ``config`` and ``layout`` (what a checkpoint holds), ``checkpoint`` and
``safetensors_io`` (reading and writing it), ``tokenizer``, ``backend`` (the operators, with the
NumPy reference backend), ``model`` (the Qwen3 forward and ``CausalLM``, the interface every model
implements), ``kv_manager`` (the paged cache), ``sampling`` and ``generate``; ``cuda`` (the same model
as GPU kernels) and ``loading`` (choosing a backend: ``load_model``); ``evaluate`` (perplexity, KL, greedy agreement: ``fp8lab eval``); ``checkpoint_commands``,
``generate_command`` and ``eval_command`` are its subcommands of the ``fp8lab`` command line (``fp8lab.cli``). ``demo`` is the embedded trained model (``fp8lab generate``'s default),
``tiny`` the random model of the fast tests.
"""
