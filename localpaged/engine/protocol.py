"""EngineClient: what Session, the TUI, the CLI and the server need from an engine, and nothing more.

One declared interface (as vLLM's EngineClient is) that AsyncLLM (core in its own process or on a
thread), a remote OpenAI-compatible engine and the test fakes all implement, so each front end is
written once against it. The synchronous LLM is not one: it steps on its caller's thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from localpaged.engine.output import KVMap, RequestOutput
    from localpaged.sampling import SamplingParams

Prompt = str | list[int] | list[dict]


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    config: Any  # an EngineConfig as resolved by the engine: max_model_len, device, ... are known

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation under the model's chat template, ending with the assistant's turn."""
        ...

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are generated; leaving early aborts it."""
        ...

    def iter_stream(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """The blocking twin of ``stream``."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request in flight; RequestError if there is none with that id."""
        ...

    def stats(self) -> dict:
        """Blocks total/used/cached/shared, prefix hits (rate, token totals), queues, preemptions, tok/s."""
        ...

    def kv_map(self, token_ids: list[int] | None = None) -> KVMap:
        """Every KV block's state, and the blocks holding ``token_ids``' cached prefix."""
        ...

    def prefetch(self, prompt: Prompt) -> int:
        """Start a prompt's KV warm: load its prefix blocks from a disk tier, if the engine has one.

        The number of tokens loaded; 0 from an engine without a tier (a remote one keeps its own cache).
        """
        ...

    def shutdown(self) -> None:
        """Stop serving; streams in flight end with an error. Safe to call twice."""
        ...
