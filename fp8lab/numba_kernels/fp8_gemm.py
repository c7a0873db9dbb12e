"""``fp8_gemm``: the one entry point for FP8 blockwise weight GEMMs; it picks a kernel by M.

Computes ``fp8lab.reference.blockwise.gemm``; launches no kernel of its own, only the chosen kernel
(``gemv_simt`` or ``gemm_mma``, with their launch shapes and simulators). Checked in
``tests/numba_kernels/test_fp8_gemm.py``.

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

Paths (``path=``):

- ``"simt"``: ``fp8lab.numba_kernels.gemv_simt`` (warp per output column, 1 <= M <= 16), the decode path;
- ``"gemv_mma"``: ``fp8lab.numba_kernels.gemv_mma`` (tensor cores with the weights as the m16 operand, 1 <= M
  <= 32, BF16 in, float32 or BF16 out, N a multiple of 16), the decode-batch path: its time hardly grows with M;
- ``"mma"``: ``fp8lab.numba_kernels.gemm_mma`` (tensor cores, any M: tiles of 16 or 32 rows), the mid-M path
  and the large-M path off Hopper;
- ``"wgmma"``: ``fp8lab.numba_kernels.gemm_wgmma`` (Hopper's warpgroup tensor-core instruction, BF16 in, float32 or
  BF16 out), the large-M (prefill) path on a compute-capability-9.0 GPU;
- ``"auto"``: ``gemv_mma`` for 2 to 32 rows where it applies, else ``simt`` for ``M <= SIMT_MAX_M``, ``wgmma`` from
  ``WGMMA_MIN_M`` rows where its grid has at least ``WGMMA_MIN_CTAS`` CTAs and it applies (and the GPU has it:
  ``has_wgmma``), and ``mma`` otherwise. The thresholds come from ``bench/gemm.py`` and ``bench/gemv_mma.py`` on an H200 (``bench/RESULTS.md``):
  at M = 2 to 8 ``gemv_mma`` takes 0.5 to 0.8 times the SIMT GEMV's time at the Qwen3 shapes (at M = 1 the SIMT
  GEMV is faster), at 9 to 16 it reads the weights once where ``gemm_mma``'s 16-row tiles re-read them per
  column tile, and past 4 rows the SIMT GEMV loses to the tensor cores. 17 to 32 rows follow without a
  measurement yet: at M = 32 ``gemm_mma`` took 1.9 to 2.5 times cuBLAS BF16 (fewer CTAs than SMs, each walking
  all of K), where ``gemv_mma`` splits K over a CTA's warps and its time hardly grew from 1 to 16 rows.

Both kernels check their arguments before launching (``arguments.check_gemm``); the stricter of
the two rules applies to ``auto`` too, so a call that works for one M works for every M: K and
block_k multiples of 128, block_n a multiple of 8, 16-bit activations. Nothing is launched on a
bad call. Checked against ``fp8lab.reference.blockwise.gemm`` through the kernels' own tests and
``tests/numba_kernels/test_fp8_gemm.py``.
"""

from __future__ import annotations

from . import arguments, bits
from .gemm_mma import gemm_mma
from .gemm_wgmma import Tiling as WgmmaTiling
from .gemm_wgmma import gemm_wgmma
from .gemv_mma import MAX_ROWS as GEMV_MMA_MAX_ROWS
from .gemv_mma import ROWS_PER_WARP, gemv_mma
from .gemv_simt import gemv_simt

SIMT_MAX_M = 4
"""Largest M routed to the SIMT GEMV by ``path="auto"`` (measured; see the module docstring)."""
WGMMA_MIN_M = 128
"""Smallest M routed to ``gemm_wgmma`` by ``path="auto"``: one full tile of 128 tokens."""
WGMMA_MIN_CTAS = 48
"""...and only where its grid has at least this many CTAs (128 weight rows x 128 tokens each). Measured on an H100
(``bench/RESULTS.md``, nineteenth and twentieth sessions): at M = 1,024 to 4,096 ``gemm_wgmma`` is 2.6 to 2.8 times
``gemm_mma``; at M = 128 and 256 it was faster with grids of 48, 64, 96 and 192 CTAs (1.5 to 2.1 times) and slower
with 32 (4096 x 4096 at M = 128: 56.8 us against 48.2)."""
PATHS = ("auto", "simt", "gemv_mma", "mma", "wgmma")


def has_wgmma() -> bool:
    """Whether this process's GPU runs ``wgmma`` (compute capability 9.0 exactly: sm_100 dropped it); the CUDA
    simulator runs the twin."""
    if bits.SIMULATOR:
        return True
    from numba import cuda

    return cuda.is_available() and tuple(cuda.get_current_device().compute_capability) == (9, 0)


def choose_path(m: int, n: int, activation: str = "bf16", output: str = "f32", wgmma: bool | None = None) -> str:
    """The kernel ``path="auto"`` uses for ``m`` rows of ``activation`` into ``n`` columns of ``output``; ``wgmma``:
    whether the GPU has it (``None``: ``has_wgmma()``)."""
    bf16_in_out = activation == "bf16" and output in ("f32", "bf16")
    if 2 <= m <= GEMV_MMA_MAX_ROWS and n % ROWS_PER_WARP == 0 and bf16_in_out:
        return "gemv_mma"
    if m <= SIMT_MAX_M:
        return "simt"
    tile = WgmmaTiling()  # gemm_wgmma's default: its CTAs cover tile.tokens rows x tile.cta_n columns
    wgmma_ctas = -(-m // tile.tokens) * -(-n // tile.cta_n)
    if m >= WGMMA_MIN_M and wgmma_ctas >= WGMMA_MIN_CTAS and bf16_in_out and (has_wgmma() if wgmma is None else wgmma):
        return "wgmma"
    return "mma"


def fp8_gemm(a, q, scale_inv, out, block=(128, 128), path: str = "auto", stream=0):
    """``out = a @ dequantize(q, scale_inv, block)^T`` with the kernel ``path`` names; returns ``out``.

    ``a``: ``[M, K]`` BF16 bits (uint16/int16) or float16; ``q``: uint8 E4M3 codes ``[N, K]``;
    ``scale_inv``: float32 ``[ceil(N/BN), ceil(K/BK)]``; ``out``: ``[M, N]`` float32, float16 or
    BF16 bits; ``stream``: a Numba stream or a ``cuda.core`` GraphBuilder (0: default stream).
    """
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    problem = arguments.check_gemm(a, q, scale_inv, out, block, kernel="fp8_gemm", activations=("bf16", "f16"),
                                   block_n_multiple=8)
    if path == "auto":
        path = choose_path(problem.m, problem.n, problem.activation, problem.output)
    kernel = {"simt": gemv_simt, "gemv_mma": gemv_mma, "mma": gemm_mma, "wgmma": gemm_wgmma}[path]
    return kernel(problem.a, problem.q, problem.scale_inv, problem.out, problem.block, stream=stream)
