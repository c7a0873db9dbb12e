"""Run code in a fresh interpreter in which some packages cannot be imported, as where they are not
installed: how a test shows that a layer of fp8lab (the oracle, the kit, the command line) needs only its
own dependencies. ``run_without(blocked, code, *args, cwd=...)``; the blocker is a meta path finder that
raises ``ImportError`` for every module of a blocked top-level package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        '''Refuses the packages a layer must not need, as if they were not installed.'''
        def __init__(self, names):
            self.names = set(names)
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in self.names:
                raise ImportError(f'{name} is blocked: this layer must not need it')
            return None

    sys.meta_path.insert(0, Block(sys.argv[1].split(',')))
    """
)


def run_without(blocked: list[str], code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which importing any of ``blocked`` fails (the checkout's
    ``fp8lab`` first on the path); ``args`` follow as ``sys.argv[2:]``."""
    source = BLOCKER + textwrap.dedent(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", source, ",".join(blocked), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
