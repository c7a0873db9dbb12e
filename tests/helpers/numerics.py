"""Float32 error-analysis vocabulary and test data that many test modules share.

- ``U = 2^-24``: float32's unit roundoff; ``gamma(n) = n u / (1 - n u)``, the classic bound on the
  relative error of ``n`` float32 roundings (Higham, *Accuracy and Stability of Numerical
  Algorithms*, section 3.1).
- ``spread_activations(rng, shape, spread)``: random float32 rows with all 24 bits in use, no zeros,
  magnitudes varying by row over ``10^+-spread``.
"""

from __future__ import annotations

import numpy as np

U = 2.0**-24


def gamma(n) -> float:
    """``n u / (1 - n u)``: the relative error bound of ``n`` float32 roundings."""
    return n * U / (1 - n * U)


def spread_activations(rng, shape, spread=3.0) -> np.ndarray:
    """Random float32 with all 24 bits, no zeros, magnitudes varying by row over ``10^+-spread``."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, shape[:-1] + (1,))
    return x.astype(np.float32)
