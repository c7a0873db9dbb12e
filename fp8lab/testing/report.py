"""What the kit says when an implementation is wrong: the ``BugClass`` it names, the ``Report`` and the
``KernelCheckFailed`` that carries it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class BugClass:
    """One known mistake: ``name`` (an identifier), ``summary`` (one line), the ``operator`` it
    concerns and its ``mutant`` (the oracle of that operator with the mistake)."""

    name: str
    operator: str
    summary: str
    mutant: Callable


@dataclass
class Report:
    """A failed check: the ``operator``, the smallest failing input found (``inputs``, by name), the
    output that is wrong (``output``), the first wrong element's ``index``, ``expected`` and ``actual``
    values there, the ``tolerance`` that applies (in words), how many elements are wrong, and the
    bug classes (``fp8lab.testing.bugs``) whose mutant reproduces the wrong output (``diagnoses``)."""

    operator: str
    inputs: dict
    output: str
    index: tuple
    expected: object
    actual: object
    tolerance: str
    wrong: int
    total: int
    diagnoses: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fp8lab.testing: {self.operator} is wrong: {self.wrong} of {self.total} elements of "
                 f"'{self.output}' outside the tolerance ({self.tolerance})",
                 f"  first at index {self.index}: expected {self.expected!r}, got {self.actual!r}",
                 "  smallest failing input:"]
        with np.printoptions(precision=9, threshold=64, edgeitems=4, linewidth=100):
            for name, value in self.inputs.items():
                text = repr(value) if not isinstance(value, np.ndarray) else \
                    f"{value.dtype}{list(value.shape)} " + np.array2string(value, separator=", ").replace("\n", " ")
                lines.append(f"    {name} = {text}")
        if self.diagnoses:
            lines.append("  consistent with these known bug classes (their mutant of the oracle gives exactly this output):")
            lines += [f"    - {b.name}: {b.summary}" for b in self.diagnoses]
        else:
            lines.append("  no known bug class of fp8lab.testing.bugs reproduces this output")
        return "\n".join(lines)


class KernelCheckFailed(AssertionError):
    """Raised by a ``check_*`` function; ``report`` holds the ``Report`` (its text is the message)."""

    def __init__(self, report: Report):
        super().__init__(str(report))
        self.report = report
