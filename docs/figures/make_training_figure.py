"""Draw ``demo_training_loss.png``: the demo model's training and held-out loss per step.

Reads ``tools/demo_training_log.json``, written by ``tools/train_demo.py train`` (training loss every
10 steps, held-out loss on 64 fixed 512-token windows every 250 steps).

Usage::

    python docs/figures/make_training_figure.py [OUTPUT_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
LOG = HERE.parents[1] / "tools" / "demo_training_log.json"
FILENAME = "demo_training_loss.png"


def main(out_dir: Path = HERE) -> Path:
    log = json.loads(LOG.read_text())
    train = np.array(log["train"])
    held = np.array(log["heldout"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(train[:, 0], train[:, 1], lw=0.8, color="tab:blue", alpha=0.8, label="training batch loss")
    ax.plot(held[:, 0], held[:, 1], "o-", color="tab:red", label="held-out loss (64 windows)")
    ax.set_ylim(1.0, 5.0)
    ax.set_xlabel("step (64 windows of 512 tokens each)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(f"demo Qwen3, {log['parameters'] / 1e6:.1f} M parameters: {log['steps']} steps, "
                 f"{log['train_seconds']:.0f} s on an H200")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out_dir) / FILENAME
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
