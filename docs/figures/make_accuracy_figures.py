"""Draw the figures of tutorial 08 (FP8 accuracy) from the trained demo model.

- ``accuracy_layer_error.png``: how the rounding error grows through the layers. For each depth ``l``
  the model cut after layer ``l`` (its residual stream through the final norm and the tied lm_head:
  the "logit lens") gives logits; plotted is ``||logits_cfg - logits_BF16|| / ||logits_BF16||`` for FP8
  weights, an FP8 KV cache and BF16 GEMM inputs, over the first chunks of the held-out text
  (reference backend, computed here).
- ``accuracy_kl_position.png``: mean KL(p_BF16 || p_cfg) of the next-token distribution at each
  position of a 512-token chunk (averaged over all held-out chunks), in bins of 16 positions.
- ``accuracy_context.png``: top, the BF16 model's mean NLL at each position (how much context helps);
  bottom, the perplexity deviation at that position, ``exp(NLL_cfg - NLL_BF16) - 1``, in bins of 32.

The last two read the JSON of ``fp8lab eval --compare --json`` (default ``bench/accuracy_cpu.json``,
the CPU run recorded in ``bench/RESULTS.md``).

Usage::

    python docs/figures/make_accuracy_figures.py [OUTPUT_DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp8lab.engine import demo  # noqa: E402
from fp8lab.engine.checkpoint import load_checkpoint  # noqa: E402
from fp8lab.engine.evaluate import EvalConfig, ModelRunner, fp8_checkpoint, read_eval_text, split_chunks  # noqa: E402
from fp8lab.engine.model import Qwen3Model  # noqa: E402
from fp8lab.engine.backend import ReferenceBackend  # noqa: E402
from fp8lab.engine.tokenizer import Tokenizer  # noqa: E402

DEFAULT_JSON = ROOT / "bench" / "accuracy_cpu.json"
LAYER_CHUNKS = 4
SERIES = {  # (label, colour, row index in the compare JSON, EvalConfig for the layer figure)
    "FP8 weights": ("tab:red", 1, EvalConfig("fp8", "bf16", "float32")),
    "FP8 KV cache": ("tab:blue", 2, EvalConfig("bf16", "fp8", "float32")),
    "FP8 weights + FP8 KV": ("tab:purple", 4, EvalConfig("fp8", "fp8", "float32")),
    "BF16 GEMM inputs (vs FP8 weights)": ("tab:green", 3, EvalConfig("fp8", "bf16", "bf16")),
}


def truncated(checkpoint, layers: int, gemm_input: str) -> Qwen3Model:
    """The checkpoint's model cut after ``layers`` decoder layers (final norm and lm_head kept)."""
    config = replace(checkpoint.config, num_hidden_layers=layers)
    return Qwen3Model(config, checkpoint.tensors, ReferenceBackend(gemm_input=gemm_input))


def layer_errors(checkpoints: dict, chunks) -> dict[str, list[float]]:
    """Relative logit-lens error after each layer, per series (see the module docstring); the BF16-inputs
    series is compared with FP8 weights on float32 inputs, the others with BF16."""
    base_cfg = EvalConfig("bf16", "bf16", "float32")
    layers = checkpoints["bf16"].config.num_hidden_layers
    out = {label: [] for label in SERIES}
    for depth in range(1, layers + 1):
        logits = {}
        for cfg in [base_cfg] + [c for _, _, c in SERIES.values()]:
            model = truncated(checkpoints[cfg.weights], depth, cfg.gemm_input)
            runner = ModelRunner(cfg, model, num_blocks=demo.CONTEXT // 16)
            logits[cfg] = np.concatenate([runner.chunk_logits(ids) for ids in chunks]).astype(np.float64)
        for label, (_, _, cfg) in SERIES.items():
            ref = logits[EvalConfig("fp8", "bf16", "float32")] if cfg.gemm_input == "bf16" else logits[base_cfg]
            out[label].append(float(np.linalg.norm(logits[cfg] - ref) / np.linalg.norm(ref)))
    return out


def binned(values, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Means of consecutive bins of ``width`` values, at the bins' centre positions."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v) // width * width
    return np.arange(n // width) * width + width / 2, v[:n].reshape(-1, width).mean(axis=1)


def draw_layer_errors(errors: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in errors.items():
        ax.plot(np.arange(1, len(values) + 1), values, "o-", color=SERIES[label][0], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layers run (then final norm + lm_head: the logit lens)")
    ax.set_ylabel("||logits - logits_ref|| / ||logits_ref||")
    ax.set_title(f"rounding error through the layers (demo model, {LAYER_CHUNKS} held-out chunks of 512)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def draw_kl_per_position(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (colour, index, _) in SERIES.items():
        key = "position_mean_kl_vs" if index == 3 else "position_mean_kl_baseline"
        x, y = binned(rows[index][key], 16)
        ax.plot(x, y, color=colour, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("position in the 512-token chunk (context length)")
    ax.set_ylabel("mean KL(p_ref || p) per token (nats)")
    ax.set_title("KL divergence of the next-token distribution by position")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def draw_context(rows: list[dict], path: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    base = np.asarray(rows[0]["position_mean_nll"])
    x, y = binned(base, 32)
    top.plot(x, np.exp(y), "k-")
    top.set_ylabel("BF16 perplexity at the position")
    top.set_title("how context helps, and what FP8 costs at each context length")
    top.grid(alpha=0.3)
    for label, (colour, index, _) in SERIES.items():
        ref = np.asarray(rows[rows[index]["vs"] if index == 3 else 0]["position_mean_nll"])
        delta = np.asarray(rows[index]["position_mean_nll"]) - ref
        x, y = binned(delta, 32)
        bottom.plot(x, 100 * np.expm1(y), "o-", ms=3, color=colour, label=label)
    bottom.axhline(0, color="k", lw=0.6)
    bottom.set_xlabel("position in the 512-token chunk (context length)")
    bottom.set_ylabel("perplexity deviation (%)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=HERE)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    rows = json.loads(args.json.read_text())["rows"]
    bf16 = load_checkpoint(demo.DEMO_DIR, progress=False)
    checkpoints = {"bf16": bf16, "fp8": fp8_checkpoint(bf16)}
    text = read_eval_text(demo.HELDOUT_TEXT, Tokenizer.from_dir(demo.DEMO_DIR), max_tokens=LAYER_CHUNKS * demo.CONTEXT)
    paths = [args.out / name for name in ("accuracy_layer_error.png", "accuracy_kl_position.png", "accuracy_context.png")]
    draw_layer_errors(layer_errors(checkpoints, split_chunks(text.ids, demo.CONTEXT)), paths[0])
    draw_kl_per_position(rows, paths[1])
    draw_context(rows, paths[2])
    return paths


if __name__ == "__main__":
    for p in main():
        print(p)
