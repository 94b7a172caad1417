"""``localpaged serve``: an OpenAI-compatible HTTP server over one shared engine.

- app.py: the FastAPI app and its routes (``build_app(engine)``);
- protocol.py: request bodies, and how each becomes SamplingParams;
- state.py: what the handlers share, and one request's way through the engine;
- streaming.py: server-sent events for ``"stream": true``;
- errors.py: OpenAI's error body; guard.py: the API key and the body-size cap;
- metrics.py: ``/metrics`` in Prometheus' format;
- runner.py: uvicorn, and stopping on Ctrl-C/SIGTERM.

Imported only by ``localpaged serve`` and by those who build the app themselves: the chat app and
the library never pay for FastAPI.
"""
