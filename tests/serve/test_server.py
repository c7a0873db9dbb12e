"""``fp8lab serve`` on the embedded demo model (the reference backend on the CPU), answered by the
official ``openai`` client and by raw HTTP.

The oracle of every text is ``fp8lab generate`` of the same prompt (greedy, or sampled with the same
seed), run through ``fp8lab.cli.main``; the chat endpoint's is ``fp8lab generate --chat``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from fp8lab import cli  # noqa: E402
from fp8lab.serve.command import ServerThread  # noqa: E402

PROMPT = "The os module provides"
MODEL = "fp8lab-demo"


@pytest.fixture(scope="module")
def server():
    s = ServerThread("--max-num-seqs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate(capsys, *argv) -> str:
    """What ``fp8lab generate ARGV`` prints to stdout for one prompt (its trailing newline dropped)."""
    capsys.readouterr()
    assert cli.main(["generate", *argv]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def post(server, path, body, raw: bytes | None = None):
    """``(status, decoded JSON)`` of a POST, errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------------------- answers


def test_greedy_completion_is_fp8lab_generate(server, client, capsys):
    want = generate(capsys, "--prompt", PROMPT, "--max-new-tokens", "12")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(server.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")


def test_streamed_completion_adds_up_to_the_whole_one(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_chat_applies_the_chat_template(server, client, capsys):
    question = "How do I read a file?"
    want = generate(capsys, "--chat", "--prompt", question, "--max-new-tokens", "16")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    template = server.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    assert r.usage.prompt_tokens == len(server.tokenizer.encode(template))
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                 max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_is_fp8lab_generate_with_that_seed(client, capsys):
    want = generate(capsys, "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0.9", "--top-p", "0.95",
                    "--seed", "7")
    for _ in range(2):  # and the same again
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
        assert r.choices[0].text == want


def test_stop_strings_end_the_text_before_them(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a piece from the middle of the greedy text
    assert stop.strip(), full
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 24
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["kv_blocks"] > 0


# ---------------------------------------------------------------------------- errors


def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"
    too_long = "word " * (server.config.max_position_embeddings + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=4)
    status, body = post(server, "/v1/completions", None, raw=b'{"model": "fp8lab-demo", "prompt": ')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    status, body = post(server, "/v1/completions", ["not", "an", "object"])
    assert status == 400
    status, body = post(server, "/v1/nothing", {})
    assert status == 404 and "error" in body
    try:
        urllib.request.urlopen(server.url + "/v1/completions", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 405 and "error" in json.loads(e.read())
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)  # still serving
    assert r.usage.completion_tokens == 3
    state = server.engine.state
    assert state.running == state.waiting == 0 and state.free_blocks == state.num_blocks


def test_the_command_line_serves_and_a_taken_port_is_one_line(tmp_path):
    """A real subprocess: it says where it listens, answers raw HTTP; a second one on the same port exits 1
    with one line naming the port."""
    first = subprocess.Popen([sys.executable, "-m", "fp8lab.cli", "serve", "--port", "0"], stderr=subprocess.PIPE,
                             text=True)
    try:
        line = ""
        while "http://" not in line:
            line = first.stderr.readline()
            assert line or first.poll() is None, "the server exited"
        url = line.split("on ", 1)[1].split("/v1", 1)[0]
        port = url.rsplit(":", 1)[1]
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == MODEL
        second = subprocess.run([sys.executable, "-m", "fp8lab.cli", "serve", "--port", port], capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 1
        errors = [line for line in second.stderr.splitlines() if line.startswith("fp8lab serve")]
        assert len(errors) == 1 and f"--port {port}" in errors[0] and "already in use" in errors[0], second.stderr
    finally:
        first.terminate()
        first.wait(30)


def test_a_client_that_disconnects_frees_its_sequence_at_once(server):
    """A streaming request for 300 tokens, dropped after its first events: the engine stops it within a
    few steps (not 300), and every KV block is free again."""
    import http.client
    import time

    steps_before = server.engine.state.steps
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    connection.close()  # gone mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = server.engine.state
        if state.running == state.waiting == 0:
            break
        time.sleep(0.01)
    assert state.running == state.waiting == 0 and state.free_blocks == state.num_blocks, state
    assert state.steps - steps_before < 100, state.steps - steps_before


def test_without_aiohttp_serve_names_its_extra(tmp_path):
    from helpers.imports import run_without

    result = run_without(["aiohttp"], """
        import sys
        from fp8lab import cli
        sys.exit(cli.main(['serve']))
    """, cwd=tmp_path)
    assert result.returncode == 1 and not result.stdout
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fp8lab serve: ")
    assert 'pip install "fp8lab[serve]"' in result.stderr
