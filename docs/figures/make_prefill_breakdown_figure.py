"""Draw tutorial 07's prefill breakdown, before and after prefill graphs and the GEMM's L2-only activations, from
``docs/data/prefill_breakdown_h100.json``.

``prefill_breakdown.png``: one 1,000-token Qwen3-8B prefill (random FP8 checkpoint, FP8 KV cache, H100), a stacked
bar per measured run (eager launches; the CUDA-graph replay; the replay after the warpgroup GEMM's activations moved
to L2-only copies; the replay of the twenty-ninth session), split into what its kernels do (the groups of
``make_decode_breakdown_figure.GROUPS``: the FP8 GEMMs, the norms, q/k-norm + RoPE + the cache write, attention,
the lm_head, the rest), the gaps between kernels and the host side (the measured prefill time minus the kernels'
span), in milliseconds; transformers BF16's prefill of the same prompt in the same run is a dashed mark on each bar.
The data are the per-kernel breakdowns ``bench/engine.py`` prints (``bench/decode_profile.profile_prefill``), copied
from four runs (``bench/RESULTS.md``, issue 16, twentieth, twenty-first and twenty-ninth sessions: the last after the
tensor-core flash prefill and the four-wide SwiGLU).

Usage::

    python docs/figures/make_prefill_breakdown_figure.py [OUTPUT_DIR]

``OUTPUT_DIR`` defaults to the folder this script lives in (``docs/figures/``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from make_decode_breakdown_figure import stacked_bar  # noqa: E402  (this folder is the script's sys.path[0])

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "prefill_breakdown_h100.json"
FILENAME = "prefill_breakdown.png"
RUNS = ("eager", "graph", "graph_cg", "graph_29")


def draw(data: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for y, name in enumerate(RUNS):
        run = data["runs"][name]
        left = stacked_bar(ax, y, run["by_label"], run["gap_us"], run["prefill_us"], "host side (prefill - kernel span)",
                           y == 0, scale=1e-3)  # milliseconds
        measured = run["prefill_us"] / 1e3
        ax.text(left + 1, y, f"measured {measured:.1f} ms: {data['prompt_len'] / measured * 1e3:,.0f} tokens/s",
                va="center", fontsize=8)
        peer = run["transformers_us"] / 1e3
        ax.plot([peer, peer], [y - 0.4, y + 0.4], color="k", ls="--", lw=1,
                label="transformers BF16, same run" if y == 0 else None)
    ax.set_yticks(range(len(RUNS)), [data["runs"][name]["label"] for name in RUNS], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(run["prefill_us"] for run in data["runs"].values()) / 1e3 * 1.3)
    ax.set_xlabel(f"milliseconds per prefill of {data['prompt_len']:,} tokens")
    ax.set_title(f"{data['shape']}, one {data['prompt_len']:,}-token prompt: the prefill forward (CUPTI kernel times, "
                 "H100)", fontsize=9)
    fig.legend(loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
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
