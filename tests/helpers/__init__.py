"""What the test modules share; test modules never import each other.

- ``helpers.engine``: tiny seeded random Qwen3 models in memory, runs over a paged cache, a fake
  tokenizer and I/O for the commands' tests, an independent float64 Qwen3 forward;
- ``helpers.cuda_twins``: NumPy twins of the GPU model's GEMM kernels, the micro model;
- ``helpers.attention``: the split-kv simulator's error bound, ALiBi slopes, filled paged caches;
- ``helpers.imports``: ``run_without``, code run in a fresh interpreter where some packages cannot be imported;
- ``helpers.edge_cases``: inputs random data never reaches (exact BF16 and E4M3 rounding ties, attention with huge scores), shared by the edge-case tests of every view;
- ``helpers.ptx``: the sm_90 compile checks: every variant compiled once, in two background processes (started by ``conftest.py`` after collection), with ptxas's resource report.

``tests/`` is on ``sys.path`` under pytest (``conftest.py`` lives there), so ``from helpers.engine
import ...`` works from every folder of the suite.
"""
