"""Figures of the mma.m16n8k16 fragment layouts and of bit placement, in the manner of NVIDIA CuTe's
layout pictures (no kernel, no oracle; ``tests/simulators/test_mma.py`` checks the tables): each matrix drawn as a grid, each cell labelled with the lane that holds it and
which of that lane's values it is (``T5 a2``: lane 5, element a2), coloured by lane.

The tables behind the pictures (``layout_table``) are plain NumPy and need nothing else; the
drawing functions import matplotlib only when called and use ``matplotlib.figure.Figure``
directly (no pyplot, no global state, no display needed). ``docs/figures/make_mma_figures.py``
writes the PNGs that the tutorials show.
"""

from __future__ import annotations

import colorsys

import numpy as np

from . import bit_placement, mma

OPERANDS = {
    # name: (coordinate map, matrix shape, element prefix, title, row axis, column axis)
    "a": (mma.A_COORDS, (mma.MMA_M, mma.MMA_K), "a", "A (16 x 16, row-major): a0..a7 per lane", "row m", "column k"),
    "b": (mma.B_COORDS, (mma.MMA_K, mma.MMA_N), "b", "B (16 x 8, k x n): b0..b3 per lane", "row k", "column n"),
    "c": (mma.C_COORDS, (mma.MMA_M, mma.MMA_N), "c", "C / D (16 x 8, float32): c0..c3 per lane", "row m", "column n"),
}


def layout_table(operand: str, weight_rows: bool = False) -> tuple[np.ndarray, np.ndarray, list[list[str]]]:
    """``(lanes, index, labels)`` for every element of operand ``'a'``, ``'b'`` or ``'c'``:
    ``lanes[r, c]`` is the lane holding element ``(r, c)``, ``index[r, c]`` which of its values
    it is, ``labels[r][c]`` the text ``'T{lane} a{i}'``. ``weight_rows=True`` (B only) gives B as
    the weight stores it, ``[n, k]``, the transpose of the ``(k, n)`` view."""
    if operand not in OPERANDS:
        raise ValueError(f"operand: expected one of {tuple(OPERANDS)}, got {operand!r}")
    coords, shape, prefix = OPERANDS[operand][:3]
    owners = np.full((*shape, 2), -1, dtype=np.int64)
    lanes, index = np.meshgrid(np.arange(mma.WARP_SIZE), np.arange(coords.shape[1]), indexing="ij")
    owners[coords[..., 0], coords[..., 1]] = np.stack([lanes, index], axis=-1)
    if weight_rows:
        if operand != "b":
            raise ValueError("weight_rows: only B is stored as weight rows [n, k]")
        owners = owners.swapaxes(0, 1)
    labels = [[f"T{lane} {prefix}{i}" for lane, i in row] for row in owners.tolist()]
    return owners[..., 0], owners[..., 1], labels


def lane_colour(lane: int) -> tuple[float, float, float]:
    """A light colour per lane: the hue follows the group id ``g = lane >> 2`` (which row of A/C,
    which column of B), the shade follows ``t = lane & 3``, so structure shows at a glance."""
    g, t = lane >> 2, lane & 3
    return colorsys.hls_to_rgb(g / 8.0, 0.62 + 0.09 * t, 0.65)


def draw_layout(ax, operand: str, weight_rows: bool = False, title: str | None = None) -> None:
    """Draw one operand's fragment layout on a matplotlib ``Axes``."""
    lanes, _, labels = layout_table(operand, weight_rows)
    rows, cols = lanes.shape
    colours = np.array([[lane_colour(int(lane)) for lane in row] for row in lanes])
    # One image for all cell colours and one set of grid lines (fast); one text per cell.
    ax.imshow(colours, extent=(0, cols, rows, 0), interpolation="nearest")
    ax.hlines(np.arange(rows + 1), 0, cols, colors="black", linewidth=0.5)
    ax.vlines(np.arange(cols + 1), 0, rows, colors="black", linewidth=0.5)
    for r in range(rows):
        for c in range(cols):
            lane_text, value_text = labels[r][c].split()
            ax.text(c + 0.5, r + 0.5, f"{lane_text}\n{value_text}", ha="center", va="center", fontsize=6.5)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)  # row 0 at the top, like a matrix
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(cols) + 0.5, [str(c) for c in range(cols)], fontsize=7)
    ax.set_yticks(np.arange(rows) + 0.5, [str(r) for r in range(rows)], fontsize=7)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    _, _, _, default_title, row_axis, col_axis = OPERANDS[operand]
    if weight_rows:
        default_title, row_axis, col_axis = "B as weight rows w[n, k] (8 x 16): b0..b3 per lane", "weight row n", "k"
    ax.set_title(title or default_title, fontsize=10, pad=18)
    ax.set_ylabel(row_axis, fontsize=8)
    ax.set_xlabel(col_axis, fontsize=8)
    ax.xaxis.set_label_position("top")


def _rectangle(xy, colour):
    from matplotlib.patches import Rectangle

    return Rectangle(xy, 1, 1, facecolor=colour, edgecolor="black", linewidth=0.5)


def fragment_figure(operand: str, weight_rows: bool = False):
    """A ``Figure`` with one operand's layout (``'a'``, ``'b'`` or ``'c'``)."""
    from matplotlib.figure import Figure

    lanes, _, _ = layout_table(operand, weight_rows)
    rows, cols = lanes.shape
    fig = Figure(figsize=(0.62 * cols + 1.2, 0.5 * rows + 1.3), dpi=120)
    draw_layout(fig.add_subplot(), operand, weight_rows)
    fig.tight_layout()
    return fig


def overview_figure():
    """A ``Figure`` with A, B and C side by side: ``D = A @ B + C`` as one warp holds it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(22, 8.6), dpi=100)
    grid = fig.add_gridspec(1, 3, width_ratios=[16, 8, 8])
    for position, operand in enumerate("abc"):
        draw_layout(fig.add_subplot(grid[0, position]), operand)
    fig.suptitle("mma.m16n8k16 fragments: lane L holds the cells labelled TL (g = L >> 2, t = L & 3)", fontsize=13)
    fig.tight_layout()
    return fig


def bit_placement_figure():
    """A ``Figure`` showing where the 8 bits of an E4M3 code land in the BF16 and F16 patterns.

    Cells carrying a code bit are strongly coloured by field (S sign, E exponent, M mantissa);
    the zero bits are coloured pale by the field of the 16-bit format they belong to."""
    from matplotlib.figure import Figure

    strong = {"S": "#e88080", "E": "#7fb0ef", "M": "#96d67f"}
    pale = {"S": "#f8dada", "E": "#dbe8fa", "M": "#e3f4dc"}
    code_fields = "SEEEEMMM"
    rows = [("E4M3 code c", code_fields, code_fields, "S.EEEE.MMM  (bias 7)")]
    for fmt, exponent_bits in (("bf16", 8), ("f16", 5)):
        shift = bit_placement.MAGNITUDE_SHIFT[fmt]
        target_fields = "S" + "E" * exponent_bits + "M" * (15 - exponent_bits)  # most significant bit first
        pattern = ["0"] * 16
        pattern[0] = "S"
        for bit in range(7):  # code bits 0..6 move up by `shift`
            pattern[15 - (bit + shift)] = code_fields[7 - bit]
        offset = bit_placement.EXPONENT_OFFSET[fmt]
        note = f"(c & 0x80) << 8 | (c & 0x7F) << {shift}  =  decode(c) * 2^-{offset}  (bias {offset + 7})"
        rows.append((fmt.upper(), "".join(pattern), target_fields, note))
    fig = Figure(figsize=(11, 3.4), dpi=120)
    ax = fig.add_subplot()
    for y, (name, bits, fields, note) in enumerate(rows):
        x0 = 16 - len(bits)  # right-align: bit 0 in the last column
        for i, (bit, field) in enumerate(zip(bits, fields)):
            colour = pale[field] if bit == "0" else strong[field]
            ax.add_patch(_rectangle((x0 + i, y * 1.6), colour))
            ax.text(x0 + i + 0.5, y * 1.6 + 0.5, bit, ha="center", va="center", fontsize=9)
            ax.text(x0 + i + 0.5, y * 1.6 + 1.2, str(len(bits) - 1 - i), ha="center", va="center", fontsize=6, color="grey")
        ax.text(-0.3, y * 1.6 + 0.5, name, ha="right", va="center", fontsize=10, weight="bold")
        ax.text(16.4, y * 1.6 + 0.5, note, ha="left", va="center", fontsize=8.5)
    ax.set_xlim(-4, 36)
    ax.set_ylim(len(rows) * 1.6, -0.4)
    ax.axis("off")
    ax.set_title("Bit placement: the code's bits move, nothing is rounded (S sign, E exponent, M mantissa)", fontsize=11)
    fig.tight_layout()
    return fig


FIGURES = {
    "mma_m16n8k16_fragments.png": overview_figure,
    "mma_a_fragment.png": lambda: fragment_figure("a"),
    "mma_b_fragment.png": lambda: fragment_figure("b"),
    "mma_b_fragment_weight_rows.png": lambda: fragment_figure("b", weight_rows=True),
    "mma_c_fragment.png": lambda: fragment_figure("c"),
    "bit_placement.png": bit_placement_figure,
}
"""File name -> function building the figure; ``write_figures`` saves them all."""


def write_figures(directory) -> list[str]:
    """Save every figure of ``FIGURES`` as a PNG in ``directory``; returns the paths written."""
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in FIGURES.items():
        path = out / name
        build().savefig(path)
        written.append(str(path))
    return written
