"""``localpaged serve``: an OpenAI-compatible HTTP server over one shared engine, which speaks Anthropic's
Messages API too.

- app.py: the FastAPI app and its routes (``build_app(engine)``);
- protocol.py: request bodies, and how each becomes SamplingParams;
- state.py: what the handlers share, and one request's way through the engine;
- streaming.py: server-sent events for ``"stream": true``;
- anthropic.py: the Messages API's routes and events; anthropic_protocol.py its request bodies,
  anthropic_tools.py its tools on the tool layer;
- errors.py: OpenAI's (and Anthropic's) error body; guard.py: the API key and the body-size cap;
- metrics.py: ``/metrics`` in Prometheus' format;
- runner.py: uvicorn, and stopping on Ctrl-C/SIGTERM.

Imported only by ``localpaged serve`` and by those who build the app themselves: the chat app and
the library never pay for FastAPI.
"""
