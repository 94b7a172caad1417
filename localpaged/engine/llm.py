"""LLM: the synchronous engine and its offline API.

``add_request`` + ``step`` is the engine loop that AsyncLLM drives from its thread;
``generate`` and ``chat`` run that loop to completion for scripts.

One bad request never affects another: whatever fails while ``step`` serves a single request
(sampling its row, stop checks, detokenizing, building its output) ends that request alone with
``finish_reason="error"`` and ``error`` set, its blocks freed. A failure of the batch as a whole
(the model's forward pass) ends every request of that batch the same way; ``step`` itself does
not raise for either, so the engine keeps serving new requests.

A request for ``n`` samples (SamplingParams.n) is n sequences of one request id that share the prompt's
KV blocks (engine.sequence, engine.scheduler): ``step`` yields an output per sample (``index`` tells them
apart), each sample finishes on its own (stop, max_tokens), ``abort`` ends all of them, and the request is
done when every sample is.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from localpaged.config import EngineConfig
from localpaged.engine.block_pool import BlockPool
from localpaged.engine.draft import DraftModel
from localpaged.engine.kv_cache_manager import KVCacheManager
from localpaged.engine.output import IncrementalDetokenizer, KVMap, RequestMetrics, RequestOutput, TokenLogprob
from localpaged.engine.protocol import EngineInfo, EngineStats
from localpaged.engine.runner import ModelRunner
from localpaged.engine.sampler import SampledToken, TokenHistory, make_generator
from localpaged.engine.scheduler import ScheduledBatch, Scheduler
from localpaged.engine.sequence import Sequence, SequenceStatus
from localpaged.engine.setup import EngineParts, build_engine_parts
from localpaged.engine.speculative import Speculator
from localpaged.engine.tokenizer import (
    Prompt,
    check_prompt_length,
    encode_chat,
    encode_prompt,
    max_prompt_chars,
    token_ids,
)
from localpaged.errors import RequestError
from localpaged.models import Progress
from localpaged.models.loader import ModelFiles
from localpaged.sampling import SamplingParams

if TYPE_CHECKING:
    from localpaged.engine.structured import StructuredOutputManager, StructuredOutputRequest

log = logging.getLogger(__name__)
# How long an idle step waits for a grammar compile (nothing else to run): short, so that new commands are read soon.
GRAMMAR_WAIT_S = 0.02


def _copy(logprobs: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
    """An output's own list, as ``token_ids`` is: later tokens do not grow an output already handed out."""
    return None if logprobs is None else list(logprobs)


@dataclass
class _SampleState:
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asks for them
    grammar: StructuredOutputRequest | None = None  # the sample's matcher, where the request has a grammar
    history: TokenHistory | None = None  # its ids on the device for its penalties, made by the sampler


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        progress: Progress | None = None,
        model_files: ModelFiles | None = None,
        **engine_config,
    ) -> None:
        """Load ``model`` (None: the default). ``model_files``: that model already resolved, as the core
        process does first so that its front end can load the tokenizer while the weights load."""
        self.config = EngineConfig(model=model, **engine_config)  # as given, never rewritten
        parts: EngineParts = build_engine_parts(self.config, progress, model_files)
        self.resolved = parts.resolved  # what the engine settled on
        self.model_name = parts.name
        self.model_folder = parts.folder
        self.engine_tokenizer = parts.tokenizer  # decodes; the full one (``tokenizer``) loads on first use
        self._max_prompt_chars = max_prompt_chars(self.engine_tokenizer, self.resolved.max_model_len)
        self.device = parts.device
        self.stop_token_ids = parts.stop_token_ids
        self.block_bytes = parts.block_bytes
        resolved = self.resolved
        self.pool = BlockPool(parts.num_blocks, resolved.block_size, resolved.enable_prefix_caching)
        use_graphs = self.device.type == "cuda" and parts.attention.name == "triton" and not self.config.enforce_eager
        self.runner = ModelRunner(
            parts.model,
            parts.attention,
            parts.num_blocks,
            resolved.block_size,
            self.device,
            parts.kv_dtype,
            graph_batch_sizes=min(resolved.max_num_seqs, 512) if use_graphs else 0,
            max_model_len=resolved.max_model_len,
            cascade=resolved.cascade_attention,
            huge_pages=resolved.huge_pages,
        )
        if parts.draft is not None:  # its K/V over the same blocks, on the same paths, without CUDA graphs
            draft = ModelRunner(
                parts.draft.model,
                parts.draft.attention,
                parts.num_blocks,
                resolved.block_size,
                self.device,
                parts.kv_dtype,
                huge_pages=resolved.huge_pages,
            )
            self.runner.drafter = DraftModel(draft, parts.model.config.vocab_size, resolved.max_num_batched_tokens)
        self.kv_disk = parts.kv_disk
        self.kv = KVCacheManager(self.pool, self.kv_disk, self.runner)
        self.speculator = (
            Speculator(resolved.speculative, resolved.speculative_max_rows, resolved.speculative_k)
            if resolved.speculative != "off"
            else None
        )
        self.scheduler = Scheduler(
            self.kv, resolved.max_num_seqs, resolved.max_num_batched_tokens, self.speculator, resolved.max_model_len
        )
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its samples, by index
        self._structured: StructuredOutputManager | None = None  # built on the first structured request
        self._compiling: dict[str, Sequence] = {}  # first samples waiting for their grammar (WAITING_FOR_FSM)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) of recent steps

    # ---- requests -------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ending with the assistant's turn."""
        return encode_chat(self.tokenizer, messages, tools)

    def _encode(self, prompt: Prompt) -> list[int]:
        ids = token_ids(prompt)
        if ids is None:  # text or a chat: the full tokenizer (loaded on first use)
            ids = encode_prompt(self.tokenizer, prompt, self._max_prompt_chars)
        vocab = self.runner.model.config.vocab_size
        if any(t >= vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _make_request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> list[Sequence]:
        """The request's samples (one unless ``params.n`` > 1), checked in full; nothing is queued yet."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams (or None for the defaults), not {type(params).__name__}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use; pick another or wait until it finishes")
        ids = self._encode(prompt)
        check_prompt_length(len(ids), self.resolved.max_model_len)
        vocab = self.runner.model.config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(
                f"stop_token_ids={params.stop_token_ids}: token ids must be below {vocab}, the model's vocabulary size"
            )
        if any(t >= vocab for t in params.logit_bias):
            raise RequestError(
                f"logit_bias names token {max(params.logit_bias)}: token ids must be below {vocab}, "
                "the model's vocabulary size"
            )
        if params.n > self.resolved.max_num_seqs:
            raise RequestError(
                f"n={params.n} samples cannot run at once with max_num_seqs={self.resolved.max_num_seqs}; "
                "ask for fewer samples or raise max_num_seqs"
            )
        return [self._make_sample(request_id, ids, params, i) for i in range(params.n)]

    def _make_sample(self, request_id: str, ids: list[int], params: SamplingParams, index: int) -> Sequence:
        """Sample ``index`` of a request with its own state: every per-sample thing is built here, and only here."""
        seq = Sequence(request_id, list(ids), params, index=index)
        seq.extra = _SampleState(
            IncrementalDetokenizer(self.engine_tokenizer, ids, params.stop),
            make_generator(params, self.device, index),
            [] if params.logprobs is not None else None,
            self._grammar(params),
        )
        return seq

    def _grammar(self, params: SamplingParams) -> StructuredOutputRequest | None:
        """A sample's grammar matcher (None without ``structured``); a spec xgrammar refuses is a RequestError."""
        if params.structured is None:
            return None
        if self._structured is None:
            from localpaged.engine.structured import StructuredOutputManager

            vocab = self.runner.model.config.vocab_size
            self._structured = StructuredOutputManager(
                self.engine_tokenizer, vocab, self.stop_token_ids, self.resolved.max_num_seqs, self.device
            )
        return self._structured.request(params.structured)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; it is checked in full first, so a bad one queues nothing. Returns its id."""
        samples = self._make_request(prompt, params, request_id)
        self._enqueue(samples)
        return samples[0].request_id

    def _enqueue(self, samples: list[Sequence]) -> None:
        first, *rest = samples
        self.requests[first.request_id] = samples
        first.forks = rest  # they fork off the first once it has prefilled the prompt
        if first.extra.grammar is not None:  # admitted once its grammar is compiled (see _start_grammars)
            first.status = SequenceStatus.WAITING_FOR_FSM
            self._compiling[first.request_id] = first
        self.scheduler.add(first)

    def abort(self, request_id: str) -> None:
        """Stop a request (every sample of it) and give its blocks back at once."""
        samples = self.requests.pop(request_id, None)
        if samples is None:
            raise RequestError(f"no running request has id {request_id!r}")
        self._compiling.pop(request_id, None)
        for seq in samples:  # the first sample first: finishing it ends the samples still waiting to fork
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def _retire(self, seq: Sequence) -> None:
        """Forget the request once its last sample has finished."""
        samples = self.requests.get(seq.request_id)
        if samples is not None and all(s.is_finished for s in samples):
            del self.requests[seq.request_id]

    def prefetch(self, prompt: Prompt) -> int:
        """Read the disk tier's blocks of ``prompt``'s prefix into the pool now, so that a request with
        that prefix starts warm (e.g. a stored chat the user just opened); the number of tokens read."""
        return self.kv.prefetch(self._encode(prompt))

    def close(self) -> None:
        """Finish writing the disk tier's pending blocks and stop using the tier (the engine serves on without it)."""
        if self.kv_disk is not None:
            self.kv.disk = None
            self.kv_disk.close()

    def settle(self) -> None:
        """Wait for what the engine finishes in the background after it starts (its weights' copy onto huge pages)
        and put it in use now: what runs next runs as every later step will, e.g. a benchmark's timed part."""
        self.runner.settle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; an output for each request that produced a token or failed.

        Never raises for a failed request or a failed forward pass: those requests end with
        ``finish_reason="error"`` (see the module docstring). Exceptions that are not ``Exception``
        (KeyboardInterrupt) propagate; ``generate`` aborts its requests on the way out.
        """
        start = time.perf_counter()
        outputs = self._start_grammars() if self._compiling else []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self._compiling:  # only requests waiting for a grammar: wait for one rather than spin
                self._structured.wait([s.extra.grammar for s in self._compiling.values()], GRAMMAR_WAIT_S)
            return outputs
        try:
            timed = self._timed_kind(batch)
            sampled = self.runner.run(batch)
            self.scheduler.on_step_done(batch, [len(t) - 1 if isinstance(t, list) else 0 for t in sampled])
        except Exception as exc:  # not attributable to one request: the batch fails, the engine goes on
            log.exception("the model step failed; ending the %d requests of its batch", len(batch.seqs))
            cause = f"the model step for this request's batch failed ({type(exc).__name__}: {exc})"
            return outputs + [out for seq in batch.seqs for out in self._fail(seq, cause)]
        tokens = 0
        for seq, new in zip(batch.seqs, sampled):
            if isinstance(new, Exception):
                log.warning("request %s failed while sampling", seq.request_id, exc_info=new)
                outputs.extend(self._fail(seq, f"sampling its next token failed ({type(new).__name__}: {new})"))
            elif new is not None:
                try:
                    outputs.append(self._on_tokens(seq, new))
                    tokens += len(new)
                except Exception as exc:  # this request's own failure: it alone ends
                    log.exception("request %s failed while processing its new token", seq.request_id)
                    cause = f"processing its new token failed ({type(exc).__name__}: {exc})"
                    outputs.extend(self._fail(seq, cause))
        now = time.perf_counter()
        if timed is not None and not self.runner.drafter.prefilled:
            self.speculator.step_timed(len(batch.seqs), timed, tokens, now - start)
        self._recent.append((now, tokens))
        return outputs

    def _timed_kind(self, batch: ScheduledBatch) -> bool | None:
        """Whether ``batch`` is a decode step with drafts (True) or without (False) that the speculator weighs
        (``Speculator.step_timed``: a draft model's); None for one it does not (prefill rows take other time, as
        does a draft's prefill of a chat it has not seen: ``DraftModel.prefilled``)."""
        if self.runner.drafter is None:
            return None
        if any(n != 1 + len(seq.spec_token_ids) for seq, n in zip(batch.seqs, batch.num_new_tokens)):
            return None
        return any(seq.spec_token_ids for seq in batch.seqs)

    def _start_grammars(self) -> list[RequestOutput]:
        """Let the requests whose grammar has compiled be admitted (every sample's matcher built); those whose
        compile failed end here."""
        failed = []
        for request_id, seq in list(self._compiling.items()):
            try:
                if not all(sample.extra.grammar.start() for sample in self.requests[request_id]):
                    continue
            except Exception as exc:  # noqa: BLE001 -- the compile's error ends this request alone
                del self._compiling[request_id]
                failed.extend(self._fail(seq, f"its grammar could not be compiled ({exc})"))
                continue
            del self._compiling[request_id]
            seq.status = SequenceStatus.WAITING
        return failed

    def _fail(self, seq: Sequence, cause: str) -> list[RequestOutput]:
        """End ``seq`` with an error, free its blocks and forget it; its final output, built without its detokenizer,
        and one each for the samples still waiting to fork off it, which end with it.

        The detokenizer may be what failed, so the output repeats only text already handed out.
        """
        waiting = list(seq.forks)
        if seq.is_finished:  # it failed after being retired (e.g. while building its final output)
            seq.finish_reason = "error"
        else:
            self.scheduler.finish(seq, "error")
        self._retire(seq)
        return [self._error_output(s, cause) for s in [seq, *waiting]]

    def _error_output(self, seq: Sequence, cause: str) -> RequestOutput:
        seq.finish_time = seq.finish_time or time.perf_counter()
        detok = seq.extra.detokenizer
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=list(seq.output_token_ids),
            text=detok.text[: detok.emitted],
            delta="",
            finished=True,
            finish_reason="error",
            metrics=self._metrics(seq),
            error=f"request {seq.request_id!r} failed: {cause}; it was stopped, other requests go on",
            logprobs=_copy(seq.extra.logprobs),
            index=seq.index,
        )

    def _on_tokens(self, seq: Sequence, new: list[SampledToken]) -> RequestOutput:
        """Append a step's tokens, one at a time, until one ends the request; one output for them all."""
        for sampled in new:
            self._on_token(seq, sampled)
            if seq.is_finished:
                break
        return self._output(seq)

    def _on_token(self, seq: Sequence, sampled: SampledToken) -> None:
        """Append the token (a stop token too: ``token_ids`` ends with it, as ``logprobs`` does) and check the stops."""
        token = sampled.token_id
        seq.append_token(token)
        state: _SampleState = seq.extra
        if state.logprobs is not None:
            state.logprobs.append(sampled.logprob)
        params: SamplingParams = seq.params
        reason = None
        # The grammar's end ends the reply, ignore_eos or not; a token it refuses fails the request.
        ended = state.grammar is not None and state.grammar.accept(token)
        if (not params.ignore_eos or ended) and (token in self.stop_token_ids or token in params.stop_token_ids):
            reason = "stop"
        else:
            state.detokenizer.add(token)
            if state.detokenizer.stopped or ended:
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.resolved.max_model_len:
                reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)
            self._retire(seq)
            seq.finish_time = time.perf_counter()

    def _output(self, seq: Sequence) -> RequestOutput:
        state: _SampleState = seq.extra
        finished = seq.is_finished
        delta = state.detokenizer.take_delta(final=finished)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=list(seq.output_token_ids),
            text=state.detokenizer.text if finished else state.detokenizer.text[: state.detokenizer.emitted],
            delta=delta,
            finished=finished,
            finish_reason=seq.finish_reason,
            metrics=self._metrics(seq),
            logprobs=_copy(state.logprobs),
            index=seq.index,
        )

    @staticmethod
    def _metrics(seq: Sequence) -> RequestMetrics:
        now = seq.finish_time or time.perf_counter()
        decode_s = now - seq.first_token_time if seq.first_token_time else 0.0
        return RequestMetrics(
            ttft_s=seq.first_token_time - seq.arrival_time if seq.first_token_time else None,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            disk_tokens=seq.num_disk_tokens,
            generated_tokens=seq.num_output_tokens,
            decode_tokens_per_s=(seq.num_output_tokens - 1) / decode_s if decode_s > 0 else None,
        )

    # ---- offline API ----------------------------------------------------------------------

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in the order of ``prompts``, and a prompt's ``n``
        samples (``SamplingParams.n``) in the order of their ``index``: one flat list, prompt after prompt.

        A request that fails is returned in its place with ``finish_reason="error"`` and ``error``
        set; the others are unaffected. Bad input raises RequestError before anything is queued.
        If this call is interrupted (KeyboardInterrupt, or any exception out of ``step``), every
        request it queued is aborted on the way out, so no blocks stay held.
        """
        if isinstance(prompts, (str, bytes, bytearray)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, dict))
        ):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(
                f"prompts must be a prompt (text, token ids or chat messages) or a list of prompts, "
                f"not {type(prompts).__name__}"
            )
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} sampling params; pass one, or one per prompt")
        # all checked before any is queued
        requests = [self._make_request(p, sp, None) for p, sp in zip(prompts, plist)]
        keys = [seq.key for samples in requests for seq in samples]
        final: dict[tuple[str, int], RequestOutput] = {}
        try:
            for samples in requests:
                self._enqueue(samples)
            mine = set(keys)
            while len(final) < len(keys):
                for out in self.step():
                    key = (out.request_id, out.index)
                    if out.finished and key in mine:  # other callers' requests may be stepped too
                        final[key] = out
        finally:
            for samples in requests:
                if self.requests.get(samples[0].request_id) is samples:
                    self.abort(samples[0].request_id)
        return [final[key] for key in keys]

    def chat(
        self, conversations: list[dict] | Seq[list[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """``generate`` over chat conversations (lists of role/content messages); fails and cleans up as it does."""
        if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        if not isinstance(conversations, (list, tuple)) or not all(
            isinstance(c, (list, tuple)) and all(isinstance(message, dict) for message in c) for c in conversations
        ):
            raise RequestError(
                "chat takes a conversation (a list of {'role': ..., 'content': ...} messages) or a list of them; "
                "for plain text or token ids use generate"
            )
        return self.generate(list(conversations), params)  # type: ignore[arg-type]

    # ---- introspection --------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (encoding, the chat template), loaded on first use: the engine itself
        decodes with ``engine_tokenizer``, which starts without transformers."""
        return self.engine_tokenizer.full

    @property
    def info(self) -> EngineInfo:
        """What this engine is: its model, context, device and what it settled on."""
        return EngineInfo.local(self.model_name, self.resolved)

    def stats(self) -> EngineStats:
        now = time.perf_counter()
        while self._recent and now - self._recent[0][0] > 3.0:
            self._recent.popleft()
        window = now - self._recent[0][0] if len(self._recent) > 1 else 0.0
        tokens = sum(n for _, n in list(self._recent)[1:])
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            tokens_per_s=tokens / window if window > 0 else 0.0,
            preemptions=self.scheduler.num_preemptions,
            blocks_total=self.pool.num_blocks,
            blocks_used=self.pool.num_used_blocks,
            blocks_cached=self.pool.num_cached_free(),
            blocks_shared=self.pool.num_shared(),
            block_bytes=self.block_bytes,
            prefix_hit_rate=self.kv.prefix_hit_rate,
            prefix_query_tokens=self.kv.prefix_queries,
            prefix_hit_tokens=self.kv.prefix_hits,
            disk_tokens=self.kv.disk_hits,
            spec_proposed_tokens=self.speculator.num_proposed if self.speculator else None,
            spec_accepted_tokens=self.speculator.num_accepted if self.speculator else None,
            **(self.kv_disk.stats() if self.kv_disk is not None else {}),
        )

    def kv_map(self, token_ids: list[int] | None = None) -> KVMap:
        """Every block's state, and the blocks that hold ``token_ids``' cached prefix (for the KV map view)."""
        states = [0] * self.pool.num_blocks
        for b in self.pool.blocks:
            if b.ref_count > 1:
                states[b.block_id] = 2
            elif b.ref_count == 1:
                states[b.block_id] = 1
            elif b.block_hash is not None:
                states[b.block_id] = 3
        highlight = self.kv.cached_prefix_blocks(list(token_ids)) if token_ids else []
        saved = sum(b.ref_count - 1 for b in self.pool.blocks if b.ref_count > 1) * self.block_bytes
        return KVMap(states, highlight, self.resolved.block_size, self.block_bytes, saved)
