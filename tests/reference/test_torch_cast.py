"""torch's ``.to(torch.float8_e4m3fn)`` against ``fp8lab.reference.e4m3.encode`` and against what
``docs/01_e4m3.md`` says it does (optional: skipped without torch).

The docs' table "What torch's cast does" lists, per torch release and device, the overflow policy
measured there. This test reads that table, finds the row of the installed torch (``major.minor.patch``)
on each device it can use, and checks: values within range round exactly as ``encode`` does (both
policies agree there), overflow and infinities follow the row's policy, NaN stays NaN. A release or
device missing from the table is skipped with a message saying so, after the in-range check ran.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fp8lab.reference import e4m3

torch = pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[2] / "docs" / "01_e4m3.md"
ROW = re.compile(r"^\| (\d+\.\d+\.\d+) \| (CPU|CUDA) \| (saturates to ±448|NaN) \| NaN \|", re.M)


def documented_policies() -> dict[tuple[str, str], bool]:
    """``{(version, device): saturates}`` from the docs' table."""
    rows = {(v, d): policy.startswith("saturates") for v, d, policy in ROW.findall(DOC.read_text(encoding="utf-8"))}
    assert rows, f"{DOC.name}: no rows found in the table of torch's cast"
    return rows


def devices() -> list[str]:
    return ["CPU"] + (["CUDA"] if torch.cuda.is_available() else [])


def torch_codes(x: np.ndarray, device: str) -> np.ndarray:
    t = torch.from_numpy(x).to("cuda" if device == "CUDA" else "cpu")
    return t.to(torch.float8_e4m3fn).view(torch.uint8).cpu().numpy()


@pytest.mark.parametrize("device", devices())
def test_in_range_values_round_as_encode_does(device, rng):
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 2.5, 20000),
                        e4m3.decode(np.arange(256, dtype=np.uint8)), [464.0, -464.0, 0.0, -0.0]]).astype(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) <= 464)]
    np.testing.assert_array_equal(torch_codes(x, device), e4m3.encode(x, saturate=True))


@pytest.mark.parametrize("device", devices())
def test_overflow_follows_the_documented_policy(device):
    version = torch.__version__.split("+")[0]
    policies = documented_policies()
    x = np.array([465.0, 480.0, 1e9, np.inf, -465.0, -1e9, -np.inf, np.nan], dtype=np.float32)
    got = torch_codes(x, device)
    assert (got[-1] & 0x7F) == 0x7F, "torch turned a NaN into a number"
    if (version, device) not in policies:
        measured = [name for name, saturate in (("saturates to ±448", True), ("NaN", False))
                    if np.array_equal(got[:-1], e4m3.encode(x[:-1], saturate=saturate))]
        assert measured, f"torch {version} on {device} follows neither policy: codes {got.tolist()} for {x.tolist()}"
        pytest.skip(f"torch {version} on {device} is not in {DOC.name}'s table yet; measured here: "
                    f"'{measured[0]}' (add the row)")
    saturate = policies[(version, device)]
    np.testing.assert_array_equal(got[:-1], e4m3.encode(x[:-1], saturate=saturate),
                                  err_msg=f"torch {version} on {device} differs from {DOC.name}")
