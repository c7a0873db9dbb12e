"""The HTTP side of ``fp8lab serve``: an aiohttp application over an ``fp8lab.engine.serving.EngineLoop``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent events
with ``stream: true``, ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Every error is
an OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) with its status: 400 for
a bad request, 404 for an unknown model or route, 405 for a wrong method, 500 when generation
failed; the server keeps serving after each.

A request's life: the handler parses and checks it (``fp8lab.serve.openai_api``), submits it to the
engine loop, and reads its events from an ``asyncio.Queue`` that the loop's thread fills
(``call_soon_threadsafe``). Stop strings are matched here (``fp8lab.serve.stops``): at one, the text
ends before it and the request is aborted, so its KV blocks are free at once. A client that
disconnects (a failed write, or the handler cancelled: the runner is made with
``handler_cancellation=True``) aborts its request the same way, in the handler's ``finally``.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from fp8lab.engine.kv_manager import KVCacheExhausted
from fp8lab.engine.serving import EngineLoop, FinishEvent, TokenEvent

from . import openai_api as api
from .stops import StopMatcher

FINISH_REASONS = {"stop": "stop", "length": "length"}
"""The engine's finish reasons as the API names them (a stop string is ``stop`` too)."""


class Server:
    """The handlers of one served model."""

    def __init__(self, engine: EngineLoop, tokenizer, model_name: str, max_positions: int, vocab_size: int):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_positions, self.vocab_size = max_positions, vocab_size
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_openai_objects], client_max_size=16 * 2**20)
        app.add_routes([web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health)])
        return app

    # -- routes

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fp8lab"}]})

    async def health(self, request: web.Request) -> web.Response:
        state = self.engine.state
        return web.json_response({"status": "ok", "running": state.running, "waiting": state.waiting,
                                  "free_kv_blocks": state.free_blocks, "kv_blocks": state.num_blocks})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        api.check_model(body, self.model_name)
        return await self._answer(request, api.parse_completion(body, self.tokenizer, self.max_positions,
                                                                self.vocab_size))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        api.check_model(body, self.model_name)
        return await self._answer(request, api.parse_chat(body, self.tokenizer, self.max_positions))

    # -- one request through the engine

    async def _answer(self, request: web.Request, parsed: api.Parsed) -> web.StreamResponse:
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        try:
            request_id = self.engine.submit(parsed.request, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        except KVCacheExhausted as e:
            raise api.ApiError(400, f"the request cannot fit in the KV cache: {e}", "max_tokens",
                               "kv_cache_exhausted") from None
        except ValueError as e:
            raise api.ApiError(400, str(e)) from None
        answer = Answer(parsed, len(parsed.request.prompt_ids), api.new_id(parsed.kind), self.model_name)
        try:
            if parsed.stream:
                return await self._stream(request, answer, events)
            return await self._whole(answer, events)
        finally:
            if not answer.engine_done:  # a stop string, a disconnect, an error: free the sequence now
                self.engine.abort(request_id)

    async def _whole(self, answer: "Answer", events: asyncio.Queue) -> web.Response:
        parts = []
        while answer.finish_reason is None:
            parts.append(answer.take(await events.get()))
        return web.json_response(api.response(answer.parsed.kind, answer.id, answer.model, "".join(parts),
                                              answer.finish_reason, answer.usage()))

    async def _stream(self, request: web.Request, answer: "Answer", events: asyncio.Queue) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        kind = answer.parsed.kind

        async def send(obj) -> None:
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if kind == "chat":
            await send(api.chunk(kind, answer.id, answer.model, "", role=True))
        try:
            while answer.finish_reason is None:
                text = answer.take(await events.get())
                if text:
                    await send(api.chunk(kind, answer.id, answer.model, text))
        except api.ApiError as e:  # the status line is sent already: the error goes in the stream
            await send(e.body())
        else:
            await send(api.chunk(kind, answer.id, answer.model, None if kind == "chat" else "", answer.finish_reason))
            if answer.parsed.include_usage:
                await send(api.usage_chunk(kind, answer.id, answer.model, answer.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class Answer:
    """One request's answer as its events arrive: the text to send, the token count, the finish reason."""

    def __init__(self, parsed: api.Parsed, prompt_tokens: int, response_id: str, model: str):
        self.parsed, self.prompt_tokens, self.id, self.model = parsed, prompt_tokens, response_id, model
        self.matcher = StopMatcher(parsed.stops)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.engine_done = False  # the engine sent its FinishEvent: nothing left to abort

    def take(self, event) -> str:
        """The text ``event`` adds to the answer; sets ``finish_reason`` when the answer is complete.
        A failed generation is an ``ApiError`` (500)."""
        if isinstance(event, TokenEvent):
            self.completion_tokens += len(event.token_ids)
            text, stopped = self.matcher.push(event.text)
            if stopped:
                self.finish_reason = "stop"
            return text
        assert isinstance(event, FinishEvent)
        self.engine_done = True
        result = event.result
        if result.finish_reason not in FINISH_REASONS:
            raise api.ApiError(500, f"generation failed: {result.error or result.finish_reason}", kind="server_error")
        self.finish_reason = FINISH_REASONS[result.finish_reason]
        return self.matcher.flush()

    def usage(self) -> dict:
        return api.usage(self.prompt_tokens, self.completion_tokens)


async def _json_body(request: web.Request):
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise api.ApiError(400, f"the request body is not valid JSON: {e}") from None


@web.middleware
async def _errors_as_openai_objects(request: web.Request, handler):
    """Every error as an OpenAI error object with its status code."""
    try:
        return await handler(request)
    except api.ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return web.json_response(api.ApiError(e.status, f"{request.method} {request.path}: {e.reason}",
                                              kind=kind).body(), status=e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # a bug: say so, keep serving
        return web.json_response(api.ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                              kind="server_error").body(), status=500)
