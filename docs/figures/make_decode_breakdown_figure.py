"""Draw tutorial 07's decode-step breakdown, before issue 15, after its first kernels and now, from
``docs/data/decode_breakdown_h200.json``.

``decode_breakdown.png``: for each shape (Qwen3-0.6B, Qwen3-8B, batch 1) a stacked bar per measured
run (``before`` the issue's changes, ``after`` its first kernels, ``now``), the decode step split into what its kernels do (the
FP8 GEMVs, the norms, q/k-norm + RoPE + the cache write, attention, the lm_head, the argmax, the rest),
the gaps between kernels and the host side (the measured step time minus the kernels' span: the
Python work before the graph replay, while the GPU waits; about 0 since steps are pipelined, the ``now`` run),
in microseconds per step; the bandwidth
roofline of the step is a dashed line. The data are the
per-kernel breakdowns ``bench/engine.py`` prints (CUPTI kernel times of CUDA-graph replays,
``bench/decode_profile.py``), copied from three runs on an H200 (``bench/RESULTS.md``). Since programmatic
dependent launch (the ``now`` run) the kernels overlap, so that run's times are what each kernel adds to
the step (from the previous kernel's end to its own end, its gap included): they partition the span, and
its gaps are 0.

Usage::

    python docs/figures/make_decode_breakdown_figure.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "decode_breakdown_h200.json"
FILENAME = "decode_breakdown.png"

GROUPS = [  # (name, colour, does a plan label belong to it)
    ("FP8 GEMV / GEMM", "C0", lambda label: "gemv" in label or "fp8_gemm" in label),
    ("RMSNorm (+ residual add)", "C1", lambda label: label in ("input norm", "post-attention norm", "final norm")),
    ("q/k-norm, RoPE, cache write", "C2", lambda label: label.startswith(("q/k norm", "rope", "cache write"))),
    ("attention", "C3", lambda label: label.startswith("attention")),
    ("lm_head (BF16)", "C4", lambda label: label.startswith("lm_head")),
    ("argmax", "C5", lambda label: label == "argmax"),
    ("the rest", "C7", lambda label: True),
]


def grouped(by_label: dict) -> dict:
    """Microseconds per step of each group of ``GROUPS`` (each label counted once, in the first group it fits)."""
    out = {name: 0.0 for name, _, _ in GROUPS}
    for label, value in by_label.items():
        name = next(name for name, _, belongs in GROUPS if belongs(label))
        out[name] += value["us"]
    return out


def stacked_bar(ax, y: float, by_label: dict, gap_us: float, total_us: float, host_label: str, legend: bool,
                scale: float = 1.0) -> float:
    """One run's bar at ``y``: its kernels' microseconds by group (``GROUPS``), the gaps between kernels and the host
    side (``total_us`` minus the two, at least 0), each times ``scale``; the parts labelled for the legend when
    ``legend``. Returns the bar's length."""
    left = 0.0
    for (name, colour, _), us in zip(GROUPS, grouped(by_label).values()):
        ax.barh(y, us * scale, left=left, color=colour, label=name if legend and us > 0 else None)
        left += us * scale
    ax.barh(y, gap_us * scale, left=left, color="white", edgecolor="0.4", hatch="//",
            label="gaps between kernels" if legend else None)
    left += gap_us * scale
    host = max(total_us * scale - left, 0.0)  # graph replays: the total is the span, within noise
    ax.barh(y, host, left=left, color="0.8", edgecolor="0.4", label=host_label if legend else None)
    return left + host


def draw(data: dict, path: Path) -> None:
    shapes = list(data["shapes"])
    fig, axes = plt.subplots(len(shapes), 1, figsize=(9, 1.9 + 1.5 * len(shapes)), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        runs = data["shapes"][shape]
        measured = [run for run in ("before", "after", "now") if run in runs]
        for y, run in enumerate(measured):
            profile = runs[run]
            left = stacked_bar(ax, y, profile["by_label"], profile["gap_us"], profile["step_us"],
                               "host side (step - kernel span)", shape == shapes[0] and run == "before")
            ax.text(left * 1.01, y, f"{left / 1e3:.2f} ms per step, {profile['kernels_per_step']} kernels", va="center",
                    fontsize=8)
        roofline = runs["roofline_us"]
        ax.axvline(roofline, color="k", ls="--", lw=1)
        ax.text(roofline, len(measured) - 0.55, f" roofline {roofline / 1e3:.2f} ms", fontsize=8, va="top")
        ax.set_yticks(range(len(measured)), [f"{run} ({runs[run + '_label']})" for run in measured], fontsize=8)
        ax.set_ylim(-0.6, len(measured) - 0.1)
        ax.invert_yaxis()
        ax.set_title(f"{shape}, batch 1: one decode step (CUDA-graph replay, CUPTI kernel times)", fontsize=9)
        ax.set_xlim(0, max(runs[run]["step_us"] for run in measured) * 1.35)
    axes[-1, 0].set_xlabel("microseconds per decode step")
    fig.legend(loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else HERE
    out.mkdir(parents=True, exist_ok=True)
    draw(json.loads(DATA.read_text()), out / FILENAME)
    print(f"wrote {out / FILENAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
