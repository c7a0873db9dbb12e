"""``fp8lab serve`` on the ``cuda`` backend (GPU only): the server's engine thread drives the GPU model.

Raw HTTP (``urllib``), so that it needs no more than the ``serve`` extra; the oracle is ``fp8lab generate
--backend cuda`` of the same prompt, run through ``fp8lab.cli.main``.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest

pytest.importorskip("aiohttp")

from fp8lab import cli  # noqa: E402
from fp8lab.serve.command import ServerThread  # noqa: E402

PROMPT = "The os module provides"
MODEL = "fp8lab-demo"


def completion(server, prompt: str, max_tokens: int) -> dict:
    """The decoded JSON of a greedy, non-streaming ``/v1/completions`` answer (an HTTP error raises)."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.gpu
def test_gpu_serve_on_the_cuda_backend_is_fp8lab_generate(capsys):
    """A greedy answer alone is ``fp8lab generate --backend cuda``'s; four at once are all answered in full and
    leave the cache all free. (Their texts may differ from each alone: a prefill of more than ``f32_max_rows``
    tokens feeds the FP8 GEMMs BF16-rounded inputs.)"""
    s = ServerThread("--backend", "cuda", "--max-num-seqs", "4")
    try:
        capsys.readouterr()
        assert cli.main(["generate", "--backend", "cuda", "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
        want = capsys.readouterr().out
        assert want.endswith("\n")
        one = completion(s, PROMPT, 12)
        assert one["choices"][0]["text"] == want[:-1]
        assert one["usage"]["completion_tokens"] == 12
        prompts = [PROMPT, "import numpy as np", "class Point:", "The json module"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: completion(s, p, 12), prompts))
        assert all(a["usage"]["completion_tokens"] == 12 or a["choices"][0]["finish_reason"] == "stop"
                   for a in answers)
        state = s.engine.state
        assert state.running == state.waiting == 0 and state.free_blocks == state.num_blocks
    finally:
        s.stop()
