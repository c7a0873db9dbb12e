"""Shared by the sm_90 PTX checks: run a compile script with the CUDA simulator off, read ptxas's report.

A process chooses the simulator once, when it first imports Numba, so the checks compile in a
subprocess (``run_compiled``, ``run_compiled_in_parts``). Those scripts may ``from helpers.ptx import
ptxas_report``: the environment puts this folder on their path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_env() -> dict:
    """The environment of a compile subprocess: simulator off, the project and this folder importable."""
    return dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))


def run_compiled(source: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -c source`` with the simulator off; its completed process (output as text)."""
    return subprocess.run([sys.executable, "-c", source], check=False, cwd=ROOT, env=compile_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_compiled_in_parts(source: str, parts: int = 2, timeout: int = 600) -> list[str]:
    """Run ``source PART PARTS`` for every part at once (compilers are slow; each part takes a share of
    the variants); assert each ends with ``ok`` and return their outputs."""
    processes = [subprocess.Popen([sys.executable, "-c", source, str(i), str(parts)], cwd=ROOT, env=compile_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(parts)]
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0 and stdout.strip().endswith("ok"), stderr[-3000:]
        outputs.append(stdout)
    return outputs


def ptxas_report(ptx: str) -> str | None:
    """ptxas's resource report (registers, spills) of ``ptx`` through nvJitLink, or None where it is not installed."""
    try:
        from cuda.bindings import nvjitlink
    except ImportError:
        return None
    handle = nvjitlink.create(2, ["-arch=sm_90", "-verbose"])
    data = ptx.encode()
    nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
    nvjitlink.complete(handle)
    log = bytearray(nvjitlink.get_info_log_size(handle))
    nvjitlink.get_info_log(handle, log)
    nvjitlink.destroy(handle)
    return log.decode(errors="replace")
