"""The server's pure parts: stop strings over split text, and the checks of OpenAI request bodies."""

from __future__ import annotations

import pytest
from helpers.engine import FakeTokenizer
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.serve import openai_api as api
from fp8lab.serve.stops import StopMatcher

ALPHABET = "ab\n"  # few letters: stop strings occur, and overlap, often


def cut(text: str, where: list[int]) -> list[str]:
    points = sorted({min(w, len(text)) for w in where})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
                                                              max_size=3), where=st.lists(st.integers(0, 40)))
def test_stops_over_pieces_are_the_first_occurrence_in_the_whole_text(text, stops, where):
    """However the text is cut into pieces, what is sent is the text up to the first stop string (the
    earliest start among all of them), or all of it."""
    matcher, sent, stopped = StopMatcher(stops), [], False
    for piece in cut(text, where):
        out, stopped = matcher.push(piece)
        sent.append(out)
        if stopped:
            break
    if not stopped:
        sent.append(matcher.flush())
    hits = [text.find(s) for s in stops if s in text]
    assert "".join(sent) == (text[: min(hits)] if hits else text)
    assert stopped == bool(hits)


def test_text_is_held_back_only_while_it_could_start_a_stop():
    m = StopMatcher(["</s>"])
    assert m.push("hello <") == ("hello ", False)
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)
    assert m.push("</s> more") == ("", True)
    assert m.push("later") == ("", True) and m.flush() == ""
    with pytest.raises(ValueError, match="stop"):
        StopMatcher([""])


# ---------------------------------------------------------------------------- request bodies

TOKENIZER = FakeTokenizer()
MAX_POSITIONS, VOCAB = 64, 300


def completion(**body):
    return api.parse_completion({"model": "m", "prompt": "hello", **body}, TOKENIZER, MAX_POSITIONS, VOCAB)


def test_defaults_and_clamps():
    p = completion()
    assert p.request.max_new_tokens == api.COMPLETIONS_DEFAULT_MAX_TOKENS and p.request.sampling.temperature == 1.0
    assert not p.stream and p.stops == ()
    room = MAX_POSITIONS - len(TOKENIZER.encode("hello"))
    assert completion(max_tokens=10_000).request.max_new_tokens == room
    assert completion(prompt=[1, 2, 3], top_k=-1, temperature=0).request.sampling.greedy
    assert completion(stop="x").stops == ("x",) and completion(stop=["x", "y"]).stops == ("x", "y")
    chat = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                          TOKENIZER, MAX_POSITIONS)
    assert chat.kind == "chat" and chat.request.max_new_tokens == MAX_POSITIONS - len(chat.request.prompt_ids)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"n": 3}, "n"), ({"logprobs": 1}, "logprobs"),
    ({"stop": ["a"] * 5}, "stop"), ({"stop": [""]}, "stop"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, VOCAB]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1] * MAX_POSITIONS}, "prompt"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_bad_fields_are_400_naming_the_field(body, param):
    with pytest.raises(api.ApiError) as e:
        completion(**body)
    assert e.value.status == 400 and e.value.param == param and e.value.body()["error"]["param"] == param


def test_the_model_is_checked():
    api.check_model({"model": "m"}, "m")
    with pytest.raises(api.ApiError) as e:
        api.check_model({"model": "other"}, "m")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(api.ApiError) as e:
        api.check_model([], "m")
    assert e.value.status == 400
