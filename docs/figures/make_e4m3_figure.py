"""Draw ``e4m3_values.png``: where the E4M3 values lie and how far apart they are.

Top panel: the 126 positive finite E4M3 values on a log2 axis (subnormals in another colour,
with 240 and 448 marked). Bottom panel: the gap from each value to the next one, as a step plot
on a log scale.

Usage::

    python docs/figures/make_e4m3_figure.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: make `reference` importable
    sys.path.insert(0, str(ROOT))

from fp8lab.reference import e4m3  # noqa: E402

FILENAME = "e4m3_values.png"


def positive_values() -> tuple[np.ndarray, np.ndarray]:
    """Codes 0x01..0x7E and their values: every positive finite E4M3 number, in increasing order."""
    codes = np.arange(0x01, e4m3.MAX_CODE + 1)
    return codes, e4m3.VALUES[codes].astype(np.float64)


def draw(out_dir: Path) -> Path:
    codes, values = positive_values()
    subnormal = e4m3.fields(codes.astype(np.uint8))[1] == 0
    log2v = np.log2(values)

    fig, (ax_v, ax_s) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True, height_ratios=[1, 1.3])

    # (a) the values themselves, one stem per code
    ax_v.vlines(log2v[subnormal], 0, 1, color="tab:orange", lw=1.4, label=f"subnormal ({subnormal.sum()} codes)")
    ax_v.vlines(log2v[~subnormal], 0, 1, color="tab:blue", lw=1.0, label=f"normal ({(~subnormal).sum()} codes)")
    marks = [  # (value, label, colour, horizontal alignment, stem height)
        (e4m3.MIN_SUBNORMAL, "$2^{-9}$ = 0x01\nsmallest subnormal", "tab:orange", "left", 1.75),
        (e4m3.MIN_NORMAL, "$2^{-6}$ = 0x08\nsmallest normal", "tab:blue", "left", 1.25),
        (1.0, "1 = 0x38", "tab:blue", "center", 1.25),
        (240.0, "240 = 0x77\nfnuz max,\nordinary here", "tab:red", "right", 1.25),
        (e4m3.MAX, "448 = 0x7E\nlargest finite", "black", "right", 1.75),
    ]
    for value, text, color, ha, top in marks:
        x = np.log2(value)
        ax_v.vlines(x, 0, top, color=color, lw=2.2)
        ax_v.annotate(text, (x + {"left": -0.05, "center": 0.0, "right": 0.05}[ha], top + 0.03),
                      ha=ha, va="bottom", fontsize=8, color=color)
    ax_v.set_ylim(0, 2.3)
    ax_v.set_yticks([])
    ax_v.set_title("E4M3 (float8_e4m3fn): the 126 positive finite values, 8 per power of two")
    ax_v.legend(loc="upper center", fontsize=8, frameon=False, ncols=2)

    # (b) gap to the next value: constant inside each binade, doubling from one binade to the next
    gaps = np.diff(values)
    ax_s.step(log2v[:-1], gaps, where="post", color="tab:blue", lw=1.5, label="gap to the next value")
    normal = ~subnormal[:-1]
    ax_s.step(log2v[:-1][normal], values[:-1][normal] * 2.0**-3, where="post", color="gray", lw=1.0, ls="--",
              label="value / 8: the gap never exceeds it for normals")
    ax_s.axvspan(log2v[0], np.log2(e4m3.MIN_NORMAL), color="tab:orange", alpha=0.15, label="subnormal range")
    ax_s.set_yscale("log", base=2)
    ax_s.set_ylabel("spacing")
    ax_s.set_xlabel("value (log2 axis)")
    ax_s.annotate("$2^{-9}$ everywhere below $2^{-6}$", (np.log2(e4m3.MIN_SUBNORMAL) + 0.1, 2.0**-8.4), fontsize=8)
    ax_s.annotate("gap 32 from 256 to 448", (8.5, 2.0**2.6), fontsize=8, ha="center", va="top")
    ax_s.legend(loc="upper left", fontsize=8, frameon=False)
    ax_s.grid(True, which="major", alpha=0.3)

    ticks = np.arange(-9, 10)
    ax_s.set_xticks(ticks)
    ax_s.set_xticklabels([f"$2^{{{t}}}$" for t in ticks])
    ax_s.set_xlim(-9.6, 9.4)

    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILENAME
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else HERE
    print(draw(out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
