"""The OpenAI HTTP API's requests and responses, as plain data (no HTTP here).

``parse_completion`` and ``parse_chat`` turn a request body (the decoded JSON) into a ``Parsed``: the
prompt's token ids, the engine ``Request``, the stop strings and the streaming options, or raise
``ApiError`` with the status code and the OpenAI error object a client expects. The ``*_response``
and ``*_chunk`` functions build the bodies the server sends.

What is supported, and how it maps to the engine:

- ``/v1/completions``: ``prompt`` a string, a list of one string, or a list of token ids;
  ``max_tokens`` (default 16, as OpenAI's).
- ``/v1/chat/completions``: ``messages`` (``system``, ``user``, ``assistant``; ``content`` a string or
  a list of ``{"type": "text"}`` parts) through the model's chat template
  (``fp8lab.engine.tokenizer.Tokenizer.apply_chat_template``); ``max_tokens`` or
  ``max_completion_tokens`` (default: what the model's positions leave after the prompt).
- ``temperature`` (default 1, as OpenAI's; 0 is greedy), ``top_p``, ``top_k`` (an extension, as in
  vLLM: 0 or -1 disable it), ``seed`` (``default_rng([seed, 0])``: the tokens ``fp8lab generate --seed``
  gives the same prompt), ``stop`` (a string or up to 4), ``n`` (1 only), ``stream`` and
  ``stream_options.include_usage``. ``logprobs``, ``echo``, ``best_of`` > 1, ``tools`` and the like are
  refused (400) rather than ignored; ``user``, ``frequency_penalty`` and ``presence_penalty`` of 0 and
  ``logit_bias`` empty are accepted as the no-ops they are.
- ``model`` must be the served model's name (404 ``model_not_found`` otherwise).
- A prompt with no room left for a new token is ``context_length_exceeded`` (400).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from fp8lab.engine.sampling import SamplingParams
from fp8lab.engine.serving import Request

MAX_STOPS = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
NO_OP_FIELDS = {"user": None, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
"""Fields accepted when they ask for nothing (the value given here, or null)."""
REFUSED_FIELDS = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "tool_choice", "functions",
                  "function_call", "response_format", "best_of", "parallel_tool_calls", "audio", "modalities",
                  "prediction")
"""Fields fp8lab does not implement: refused when set to anything but null / false / 0 / 1 for ``best_of``."""


class ApiError(Exception):
    """An error response: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Parsed:
    """A checked request: the engine ``request``, its ``stops``, and how to answer."""

    kind: str  # "completion" or "chat"
    request: Request
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _number(body: dict, name: str, default, low=None, high=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise _bad(f"{name}: expected {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{'' if low is None else f'>= {low}'}{' and ' if low is not None and high is not None else ''}" \
                 f"{'' if high is None else f'<= {high}'}"
        raise _bad(f"{name}: expected a value {bounds}, got {value!r}", name)
    return int(value) if integer else float(value)


def check_model(body, served: str) -> None:
    """The body is a JSON object naming the served model (404 ``model_not_found`` for another)."""
    model = _object(body).get("model")
    if model is None:
        raise _bad("model: required (the served model is " + repr(served) + ")", "model")
    if model != served:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def _refuse_unsupported(body: dict) -> None:
    for name in REFUSED_FIELDS:
        value = body.get(name)
        if value in (None, False, 0) or (name == "best_of" and value == 1):
            continue
        raise _bad(f"{name}: not supported by fp8lab serve", name)
    for name, no_op in NO_OP_FIELDS.items():
        value = body.get(name)
        if name != "user" and value not in (None, no_op):
            raise _bad(f"{name}: not supported by fp8lab serve (only {no_op!r})", name)
    n = body.get("n")
    if n not in (None, 1):
        raise _bad(f"n: only n = 1 is supported, got {n!r}", "n")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise _bad(f"stop: expected a non-empty string or a list of at most {MAX_STOPS} of them, got {stop!r}", "stop")
    return tuple(stops)


def _sampling(body: dict) -> tuple[SamplingParams, int | None]:
    temperature = _number(body, "temperature", 1.0, low=0, high=2)
    top_p = _number(body, "top_p", 1.0, low=0, high=1)
    if top_p == 0:
        raise _bad("top_p: expected a value in (0, 1], got 0", "top_p")
    top_k = _number(body, "top_k", 0, low=-1, integer=True)
    seed = _number(body, "seed", None, low=0, integer=True)
    return SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p), seed


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad(f"stream: expected true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise _bad("stream_options: only with stream = true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad(f"stream_options: expected {{\"include_usage\": true | false}}, got {options!r}", "stream_options")
    return stream, bool(options.get("include_usage", False))


def _max_tokens(body: dict, names: tuple[str, ...], default: int, room: int) -> int:
    for name in names:
        if body.get(name) is not None:
            value = _number(body, name, None, low=1, integer=True)
            return min(value, room)
    return min(default, room)


def _room(prompt_ids: list[int], max_positions: int, param: str) -> int:
    """New tokens the model's positions leave after the prompt (at least 1, else ``context_length_exceeded``)."""
    if not prompt_ids:
        raise _bad(f"{param}: the prompt is empty (no tokens)", param)
    room = max_positions - len(prompt_ids)
    if room < 1:
        raise _bad(f"This model's maximum context length is {max_positions} tokens; the prompt has "
                   f"{len(prompt_ids)} tokens, which leaves no room for a completion", param, "context_length_exceeded")
    return room


def parse_completion(body, tokenizer, max_positions: int, vocab_size: int) -> Parsed:
    """A ``/v1/completions`` body (already ``check_model``'d)."""
    body = _object(body)
    _refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise _bad(f"prompt: token ids must lie in [0, {vocab_size})", "prompt")
        ids = list(prompt)
    else:
        raise _bad("prompt: expected a string, a list of one string, or a list of token ids "
                   "(one prompt per request: n = 1, no batches)", "prompt")
    room = _room(ids, max_positions, "prompt")
    sampling, seed = _sampling(body)
    stream, usage = _stream_options(body)
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    return Parsed("completion", Request(ids, max_tokens, sampling, seed), _stops(body), stream, usage)


def chat_prompt(messages, tokenizer) -> str:
    """The chat template applied to OpenAI ``messages`` (text content only)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: expected a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]: expected an object with role and content, got {message!r}", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content: expected a string or text parts, got {content!r}", "messages")
        plain.append({"role": message.get("role"), "content": content})
    try:
        return tokenizer.apply_chat_template(plain)  # the generation prompt opens the assistant turn
    except ValueError as e:
        raise _bad(str(e), "messages") from None


def parse_chat(body, tokenizer, max_positions: int) -> Parsed:
    """A ``/v1/chat/completions`` body (already ``check_model``'d)."""
    body = _object(body)
    _refuse_unsupported(body)
    ids = tokenizer.encode(chat_prompt(body.get("messages"), tokenizer))
    room = _room(ids, max_positions, "messages")
    sampling, seed = _sampling(body)
    stream, usage = _stream_options(body)
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), room, room)
    return Parsed("chat", Request(ids, max_tokens, sampling, seed), _stops(body), stream, usage)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, response_id: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    """The whole answer of a non-streaming request."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_}


def chunk(kind: str, response_id: str, model: str, text: str | None, finish_reason: str | None = None,
          role: bool = False) -> dict:
    """One server-sent event of a streaming answer: a text piece, or the last one with its finish reason
    (chat: the first chunk carries the role)."""
    if kind == "chat":
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: str, response_id: str, model: str, usage_: dict) -> dict:
    """The last event with ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage_}
