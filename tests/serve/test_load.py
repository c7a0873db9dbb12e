"""A bounded load test of ``fp8lab serve`` on the loopback address: rounds of 32 concurrent streaming
clients, a third of them disconnecting mid-stream.

Every completed answer must be the greedy text of its prompt generated alone (``Generator.generate``
of that one prompt: the oracle), every request is answered exactly once (one finish chunk, one
``[DONE]``), the KV cache is back to all blocks free after each round, and the server's memory does
not grow from round to round.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")

from fp8lab.engine.generate import Generator  # noqa: E402
from fp8lab.serve.command import ServerThread  # noqa: E402

CLIENTS = 32
ROUNDS = 3
MAX_TOKENS = 10
WORDS = "def class import return the os path file list dict value print self module function".split()


def rss_bytes() -> int:
    """This process's resident memory now (the server runs in it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def server():
    s = ServerThread("--max-num-seqs", "16")
    yield s
    s.stop()


def greedy_alone(server, prompts: list[str]) -> list[str]:
    generator = Generator(server.engine.generator.model, server.tokenizer,
                          stop_token_ids=server.engine.generator.stop_token_ids)
    return [generator.generate([p], max_new_tokens=MAX_TOKENS).results[0].text for p in prompts]


async def stream_one(session, url: str, prompt: str, disconnect_after: int | None) -> dict:
    """One streaming completion; with ``disconnect_after``, close the connection after that many events."""
    body = {"model": "fp8lab-demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    pieces, finishes, done, events = [], [], 0, 0
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            events += 1
            if line == "data: [DONE]":
                done += 1
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            pieces.append(chunk["choices"][0]["text"])
            if chunk["choices"][0]["finish_reason"]:
                finishes.append(chunk["choices"][0]["finish_reason"])
            if disconnect_after is not None and events >= disconnect_after:
                response.close()  # the client goes away mid-stream
                return {"disconnected": True}
    return {"disconnected": False, "text": "".join(pieces), "finishes": finishes, "done": done}


async def one_round(url: str, prompts: list[str]) -> list[dict]:
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(stream_one(session, url, p, 2 if i % 3 == 1 else None)
                                      for i, p in enumerate(prompts)))


def settled(server, timeout: float = 10.0):
    """The loop's state once nothing runs or waits (aborts are handled between steps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = server.engine.state
        if state.running == state.waiting == 0 and state.free_blocks == state.num_blocks:
            return state
        time.sleep(0.02)
    return server.engine.state


def test_concurrent_streams_with_disconnects(server):
    rng = np.random.default_rng(5)
    prompts = [" ".join(rng.choice(WORDS, int(rng.integers(2, 8)))) for _ in range(CLIENTS)]
    want = greedy_alone(server, prompts)
    memory = []
    for round_number in range(ROUNDS):
        answers = asyncio.run(one_round(server.url, prompts))
        completed = [(i, a) for i, a in enumerate(answers) if not a["disconnected"]]
        assert len(completed) == CLIENTS - len(range(1, CLIENTS, 3)), round_number  # none lost
        for i, a in completed:
            assert a["text"] == want[i], (round_number, i)
            assert len(a["finishes"]) == 1 and a["done"] == 1, (round_number, i, a)  # answered exactly once
        state = settled(server)
        assert state.running == state.waiting == 0 and state.free_blocks == state.num_blocks, state
        assert not server.engine._listeners  # nobody is left waiting for events
        memory.append(rss_bytes())
    # the first round warms up (tokenizer caches, aiohttp, NumPy buffers); after it, no growth per round
    assert memory[-1] - memory[1] < 32 * 2**20, [m / 2**20 for m in memory]
