"""``fp8lab serve``: an OpenAI-compatible HTTP server over the FP8 engine (the ``serve`` extra: aiohttp).

- ``fp8lab.serve.openai_api``: the API's requests (parsed and checked) and responses, as plain data;
- ``fp8lab.serve.stops``: stop strings over streamed text;
- ``fp8lab.serve.server``: the aiohttp application over ``fp8lab.engine.serving.EngineLoop``, the one
  thread that runs the model (continuous batching);
- ``fp8lab.serve.command``: the command line.

Nothing else in fp8lab imports this package; it imports the engine.
"""
