"""The one place a front end's engine is chosen: a remote server's, or our own."""

from __future__ import annotations

from localpaged.engine.protocol import EngineClient
from localpaged.models import Progress


def make_engine(
    backend: str | None = None,
    *,
    model: str | None = None,
    api_key: str | None = None,
    progress: Progress | None = None,
    **engine_config: object,
) -> EngineClient:
    """A RemoteEngine on ``backend`` (an OpenAI-compatible URL; ``model`` is then the served model's name), else our
    own AsyncLLM for ``model`` with ``engine_config``. Imported late: torch and the model load only when asked for."""
    if backend:
        from localpaged.engine.remote import RemoteEngine

        if progress is not None:
            progress(f"Connecting to {backend}", None)
        return RemoteEngine(backend, api_key=api_key, model=model)
    from localpaged.engine.async_llm import AsyncLLM

    return AsyncLLM(model, progress=progress, **engine_config)
