"""EngineClient: what Session, the TUI, the CLI and the server need from an engine, and nothing more.

One declared interface (as vLLM's EngineClient is) that AsyncLLM (core in its own process or on a
thread), RemoteEngine (any OpenAI-compatible server) and the test fakes all implement, so each front
end is written once against it. The synchronous LLM is not one: it steps on its caller's thread.
tests/test_engine_protocol.py checks at run time that every implementation has every member here
with the same signature.

Engines differ in what they can do, and front ends ask ``info.capabilities`` rather than the engine's
type: a remote server takes messages rather than token ids, may have no tokenizer to count with,
may not continue a cut-off reply, and never shows its KV pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from localpaged.config import ResolvedConfig
from localpaged.engine.tokenizer import Prompt

if TYPE_CHECKING:
    from localpaged.engine.output import KVMap, RequestOutput
    from localpaged.engine.vocabulary import Vocabulary
    from localpaged.sampling import SamplingParams

__all__ = ["LOCAL", "EngineCapabilities", "EngineClient", "EngineInfo", "EngineStats", "Prompt"]


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond streaming a chat, so front ends offer only what works."""

    token_prompts: bool  # takes token ids as a prompt (Session sends ids; else it sends messages)
    tokenize: bool  # encode_chat works (a tokenizer here, or the server's /tokenize)
    continue_reply: bool  # a chat ending in an assistant message goes on from it (continue)
    kv_pool: bool  # stats() has the block figures and kv_map() draws the pool
    tools: bool = True  # tool turns work (a remote server that refuses JSON-schema replies cannot)
    # Why a capability is off, by its field's name, in words for the user: each refusal says only its own reason.
    notes: Mapping[str, str] = field(default_factory=dict)

    def why_off(self, capability: str) -> str:
        """Why ``capability`` (a field's name) is off here, for an error or a hint."""
        return self.notes.get(capability, "this engine does not offer it")


LOCAL = EngineCapabilities(token_prompts=True, tokenize=True, continue_reply=True, kv_pool=True)


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, fixed for its lifetime: what the front ends show and plan with."""

    model_name: str
    max_model_len: int | None  # the context in tokens; None: a remote server that does not say
    device: str  # where the model runs, in words for the status line ("cpu", "cuda:0", "remote engine URL")
    block_size: int | None  # the KV pool's tokens a block; None where the pool is not in view
    capabilities: EngineCapabilities
    resolved: ResolvedConfig | None = None  # a local engine's settled configuration (``localpaged config show``)

    @classmethod
    def local(cls, model_name: str, resolved: ResolvedConfig) -> EngineInfo:
        """A local engine's info: everything from what it settled on."""
        return cls(model_name, resolved.max_model_len, resolved.device, resolved.block_size, LOCAL, resolved)


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's figures as of the end of its last step. The pool's and the disk tier's are None where an
    engine cannot see them (a remote server's pool; a local engine without a tier)."""

    running: int  # requests in the running batch
    waiting: int  # requests queued for admission
    tokens_per_s: float  # generated tokens a second, all requests, over the last few seconds
    preemptions: int | None = None  # requests preempted so far (their blocks given back, recomputed later)
    blocks_total: int | None = None
    blocks_used: int | None = None  # held by requests in flight
    blocks_cached: int | None = None  # free, still holding a cached prefix
    blocks_shared: int | None = None  # held by more than one request
    block_bytes: int | None = None  # one block's K and V of every layer
    prefix_hit_rate: float | None = None  # of the prompt tokens looked up, the share served from the cache
    prefix_query_tokens: int | None = None  # running totals of the rate's terms, for rates over any window
    prefix_hit_tokens: int | None = None
    disk_tokens: int | None = None  # of the hit tokens, those read from the disk tier
    disk_blocks: int | None = None  # the disk tier's block files
    disk_bytes: int | None = None
    disk_blocks_written: int | None = None
    disk_bytes_written: int | None = None
    disk_write_s: float | None = None  # time the tier's writer spent writing
    disk_blocks_dropped: int | None = None  # blocks not written (the tier was full of newer ones, or a write failed)
    disk_files_rejected: int | None = None  # block files that failed their checks when read
    spec_proposed_tokens: int | None = None  # draft tokens checked so far (speculative decoding; None: off)
    spec_accepted_tokens: int | None = None  # of which kept


@runtime_checkable
class EngineClient(Protocol):
    info: EngineInfo

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation under the model's chat template, ending with the assistant's turn;
        ``tools`` (OpenAI's tool definitions) rendered by the template's tool format where it has one."""
        ...

    def vocabulary(self) -> Vocabulary | None:
        """A copy of the engine's tokenizer for the caller's own use (ids to text and back, each token's bytes,
        the chat template); None where the tokenizer is not here (a remote server)."""
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

    def stats(self) -> EngineStats:
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
