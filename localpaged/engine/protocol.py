"""EngineClient: what Session, the TUI, the CLI and the server need from an engine, and nothing more.

One declared interface (as vLLM's EngineClient is) that AsyncLLM (core in its own process or on a
thread), RemoteEngine (any OpenAI-compatible server) and the test fakes all implement, so each front
end is written once against it. The synchronous LLM is not one: it steps on its caller's thread.
tests/test_engine_protocol.py checks at run time that every implementation has every member here
with the same signature.

Engines differ in what they can do, and front ends ask ``capabilities`` rather than the engine's
type: a remote server takes messages rather than token ids, may have no tokenizer to count with,
may not continue a cut-off reply, and never shows its KV pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from localpaged.engine.output import KVMap, RequestOutput
    from localpaged.sampling import SamplingParams

Prompt = str | list[int] | list[dict]


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond streaming a chat, so front ends offer only what works."""

    token_prompts: bool  # takes token ids as a prompt (Session sends ids; else it sends messages)
    tokenize: bool  # encode_chat works (a tokenizer here, or the server's /tokenize)
    continue_reply: bool  # a chat ending in an assistant message goes on from it (continue)
    kv_pool: bool  # stats() has the block figures and kv_map() draws the pool
    note: str = ""  # why some of the above are missing, in words for the user


LOCAL = EngineCapabilities(token_prompts=True, tokenize=True, continue_reply=True, kv_pool=True)


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    config: Any  # max_model_len (None: a remote server did not say) and device are known
    capabilities: EngineCapabilities

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
