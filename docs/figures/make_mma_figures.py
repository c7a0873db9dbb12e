"""Write the mma.m16n8k16 fragment-layout and bit-placement figures used by docs/02 and docs/03.

Usage (from anywhere)::

    python docs/figures/make_mma_figures.py [OUTPUT_DIR]

OUTPUT_DIR defaults to this script's folder (docs/figures/). The drawing code lives in
``fp8lab/simulators/figures.py``; this script only chooses where the PNGs go.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `simulators` importable
    sys.path.insert(0, str(REPO_ROOT))

from fp8lab.simulators import figures  # noqa: E402


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else HERE
    for path in figures.write_figures(out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
