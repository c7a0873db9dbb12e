"""How a caller stores a blockwise FP8 weight: the axis order of its codes and scale grid, and its scales' dtype.

fp8lab's contract stores a weight ``[N, K]`` (N output features, row-major, as ``nn.Linear`` and the
Hugging Face checkpoints) as E4M3 codes ``[N, K]`` and float32 ``scale_inv`` ``[ceil(N/BN), ceil(K/BK)]``.
Kernels differ in two ways, and a check takes both as parameters instead of a fork:

- ``layout="kn"``: the transpose, codes ``[K, N]`` and scales ``[ceil(K/BK), ceil(N/BN)]`` (a kernel that
  computes ``x @ W`` with W column-major in fp8lab's terms); the block is then given over the caller's
  axes, ``(BK, BN)``.
- ``scale_dtype="bfloat16"``: scales stored in BF16. NumPy has no bfloat16, so BF16 values travel as
  uint16 bit patterns (the torch adapter views them as ``torch.bfloat16``); the kit's input scales are
  BF16 values, and a quantizer's scales must be within 1 BF16 ulp of ``amax / 448``.

A check converts its inputs into the caller's format and the caller's outputs back into the contract's
before comparing, so the oracle, the tolerances and the bug classes' mutants are the same for every format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8lab.reference import dense

from .compare import FLOAT32_SCALE_TOLERANCE

LAYOUTS = ("nk", "kn")
SCALE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class WeightFormat:
    """A caller's weight format (``layout``, ``scale_dtype``: see the module docstring)."""

    layout: str = "nk"
    scale_dtype: str = "float32"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype: expected one of {', '.join(SCALE_DTYPES)}, got {self.scale_dtype!r}")

    @property
    def transposed(self) -> bool:
        return self.layout == "kn"

    @property
    def scale_tolerance(self) -> tuple[float, str]:
        """How far a quantizer's scale may be from ``amax / 448`` (relative, and in words): float32 as every
        check (``compare.FLOAT32_SCALE_TOLERANCE``); BF16 keeps 8 significant bits, so 1 ulp is 2^-7 (any
        rounding to BF16 passes, truncation included)."""
        return (2.0**-7, "1 bfloat16 ulp") if self.scale_dtype == "bfloat16" else FLOAT32_SCALE_TOLERANCE

    def __str__(self) -> str:
        return f"layout {self.layout}, {self.scale_dtype} scales"

    def block(self, block) -> tuple[int, int]:
        """The block ``(BN, BK)`` over the caller's axes."""
        return (block[1], block[0]) if self.transposed else (block[0], block[1])

    def stored_scales(self, scale_inv) -> np.ndarray:
        """float32 scales rounded to what the format stores (BF16: to nearest, ties to even), in the contract's axes."""
        s = np.asarray(scale_inv, np.float32)
        return dense.round_to_bf16(s) if self.scale_dtype == "bfloat16" else s.copy()

    def codes_to_caller(self, codes) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(codes).T) if self.transposed else np.array(codes, copy=True)

    def scales_to_caller(self, scale_inv) -> np.ndarray:
        s = self.codes_to_caller(self.stored_scales(scale_inv))
        return dense.float32_to_bf16_bits(s) if self.scale_dtype == "bfloat16" else s

    def codes_from_caller(self, codes) -> np.ndarray:
        codes = np.asarray(codes)
        return codes.T if self.transposed else codes

    def scales_from_caller(self, scales) -> np.ndarray:
        """The caller's scales as float32 values in the contract's axes; BF16 ones must be uint16 (or int16, as
        torch exports bfloat16) bit patterns, anything else is reported as a wrong dtype (``dtype_error``)."""
        s = np.asarray(scales)
        values = dense.bf16_bits_to_float32(s) if self.scale_dtype == "bfloat16" else s.astype(np.float32)
        return values.T if self.transposed else values

    def dtype_error(self, scales) -> str | None:
        """Why the caller's scales do not have the format's dtype, or None."""
        kind = np.asarray(scales).dtype
        if self.scale_dtype == "bfloat16" and kind not in (np.uint16, np.int16):
            return f"dtype {kind}, expected uint16 BF16 bit patterns"
        if self.scale_dtype == "float32" and kind.kind != "f":
            return f"dtype {kind}, expected float32"
        return None
