"""Structured outputs: a reply that must match a JSON schema, any JSON object, a regex, one of some strings,
or an EBNF grammar, built on xgrammar as vLLM v1's structured output is.

Three steps, each where it costs the step loop nothing it need not:

- ``check_structured`` parses the spec into xgrammar's Grammar (no token masks, milliseconds): a spec
  xgrammar refuses is a RequestError before the request is queued, in the front end and in ``LLM``.
- ``StructuredOutputManager.request`` compiles each distinct spec (``StructuredOutputs.key``) once, on a
  thread pool, into the token masks of the engine's vocabulary; compiled grammars are kept in a bounded
  LRU. The request waits in the scheduler (``SequenceStatus.WAITING_FOR_FSM``) until its compile is done,
  while everything else runs; a compile that fails ends that request alone.
- Per sample a GrammarMatcher (``StructuredOutputRequest``): the runner fills the step's bitmask for the
  constrained rows only and applies it to their logits (``apply_grammar_bitmask``); the engine advances
  the matcher by each accepted token, and the grammar's end ends the reply.

xgrammar (and its FFI, which loads torch) is imported on the first structured request, so an engine or a
front end that never sees one never pays for it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from localpaged.errors import RequestError
from localpaged.sampling import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar as xgr

    from localpaged.engine.engine_tokenizer import EngineTokenizer
    from localpaged.engine.sequence import Sequence

# Distinct compiled grammars kept; a typical schema's masks over a 50k vocabulary are ~100 KB, so this is
# a few tens of MB at most, and it holds every schema of a server's usual clients.
MAX_CACHED_GRAMMARS = 128
COMPILE_WORKERS = 2  # specs compiled at once: one big schema does not hold up a small one
# Whitespace xgrammar allows between JSON elements: any indentation a model uses, but not the endless
# newlines a small model falls into when any amount is allowed.
MAX_JSON_WHITESPACE = 16
_CPP_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*[^:\s]+:\d+:\s*")  # "[15:38:00] /project/cpp/x.cc:94: "
# xgrammar writes a string with minLength or maxLength as characters of this rule, which lets raw control
# characters (a tab, \x05) through where JSON allows none; they are given JSON's string characters instead.
_LOOSE_CHARACTERS = re.compile(r'^(\S+ ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
_WHAT = {
    "json": ("JSON schema", "use the JSON Schema subset xgrammar supports (type, properties, required, enum, ...)"),
    "json_object": ("JSON object grammar", "report this"),
    "regex": ("regex", "fix the pattern"),
    "choice": ("choice", "use plain strings"),
    "grammar": ("EBNF grammar", "write it as GBNF (llama.cpp's grammar format) with a `root` rule"),
}


def check_structured(spec: StructuredOutputs) -> xgr.Grammar:
    """``spec`` as xgrammar's Grammar (a parse, no token masks); a RequestError naming what xgrammar refused."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind == "json":
            text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            grammar = xgr.Grammar.from_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            ebnf, loose = _LOOSE_CHARACTERS.subn(r'\1[^\\0-\\x1f\\"\\\\]\2', str(grammar))
            return xgr.Grammar.from_ebnf(ebnf) if loose else grammar
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', strict_mode=False, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            # JSON's string escapes are GBNF's: quotes, backslashes and control characters stay literal
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            )
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # noqa: BLE001 -- whatever xgrammar raises, the caller gets one clear error
        raise _refused(kind, exc) from None


def _refused(kind: str, exc: Exception) -> RequestError:
    what, fix = _WHAT[kind]
    reason = _CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
    return RequestError(f"structured outputs: the {what} was refused ({reason}); {fix}")


class StructuredOutputManager:
    """The engine's grammar compiler and the step's bitmask; used on the engine's step thread only."""

    def __init__(
        self,
        tokenizer: EngineTokenizer,
        vocab_size: int,
        stop_token_ids: set[int] | list[int],
        max_rows: int,
        device: torch.device,
    ) -> None:
        """``tokenizer``: its vocabulary is read on the compile pool (``EngineTokenizer.vocabulary``);
        ``vocab_size``: the model's (the logits' width, which may exceed the tokenizer's); ``stop_token_ids``:
        the engine's, the only tokens a grammar's end allows; ``max_rows``: the most rows a step samples."""
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.device = device
        self._stops = sorted(stop_token_ids)
        self._executor = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="localpaged-grammar")
        self._compiler_future = self._executor.submit(self._build_compiler, tokenizer)
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self.bitmask = self._allocate(max_rows)
        self._batch = xgr.BatchGrammarMatcher()
        others = np.ones(-(-vocab_size // 32) * 32, dtype=bool)  # every token of the vocabulary but the stops
        others[vocab_size:] = False
        others[self._stops] = False
        self._not_stop = torch.from_numpy(np.packbits(others, bitorder="little").view(np.int32).copy())
        self._probe = xgr.allocate_token_bitmask(1, vocab_size)

    def _allocate(self, rows: int) -> torch.Tensor:
        bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return bitmask.pin_memory() if self.device.type == "cuda" else bitmask

    def _build_compiler(self, engine_tokenizer: EngineTokenizer) -> xgr.GrammarCompiler:
        """The compiler over the engine's vocabulary, built on the pool (it reads every token once).

        Special tokens other than the stop tokens are blanked, which xgrammar never allows: the reply's text
        is decoded without them, so a grammar must not spend them as text (``<|im_start|>`` inside a string).
        """
        xgr = self._xgr
        tokenizer = engine_tokenizer.vocabulary
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stops)
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special |= {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        }
        vocab = list(info.decoded_vocab)
        for i in special - set(self._stops):
            if i < len(vocab):
                vocab[i] = b""
        info = xgr.TokenizerInfo(
            vocab,
            xgr.VocabType.RAW,
            vocab_size=self.vocab_size,
            stop_token_ids=self._stops,
            add_prefix_space=info.add_prefix_space,
        )
        # Half the cores per compile: the step loop's threads keep the rest.
        threads = max(1, (os.cpu_count() or 2) // 2)
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def _compile(self, kind: str, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        try:
            return self._compiler_future.result().compile_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 -- ends the one request (and any with the same spec)
            raise _refused(kind, exc) from None

    def request(self, spec: StructuredOutputs) -> StructuredOutputRequest:
        """A sample's matcher-to-be for ``spec``: compiled once per distinct spec, off the step loop.

        A spec not seen before is checked here first, so a bad one is a RequestError and nothing is queued.
        """
        key = spec.key
        future = self._cache.get(key)
        if future is None:
            grammar = check_structured(spec)
            future = self._executor.submit(self._compile, spec.kind, grammar)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return StructuredOutputRequest(self, future)

    def wait(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of ``requests``' compiles is done, or ``timeout`` seconds (the step loop's idle wait)."""
        concurrent.futures.wait([r.future for r in requests], timeout, concurrent.futures.FIRST_COMPLETED)

    def apply_bitmask(self, logits: torch.Tensor, rows: list[int], requests: list[StructuredOutputRequest]) -> None:
        """Mask ``logits[rows]`` to what each row's matcher allows next; the other rows are not touched."""
        if max(rows) >= self.bitmask.shape[0]:
            self.bitmask = self._allocate(max(rows) + 1)
        self._batch.batch_fill_next_token_bitmask([r.matcher for r in requests], self.bitmask, rows)
        for i in (self.bitmask[rows] == 0).all(dim=1).nonzero().flatten().tolist():
            # Text no token of this vocabulary spells (a byte without a token): the row samples a stop token
            # instead of from no token at all, and the request fails on it with a message that says why.
            requests[i].stuck = True
            self.bitmask[rows[i], self._stops[0] // 32] = int(np.uint32(1 << self._stops[0] % 32).view(np.int32))
        bitmask = self.bitmask[: max(rows) + 1]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        if logits.is_contiguous():
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        else:  # the native kernels' logits come transposed, and xgrammar's CPU kernel misreads a column stride
            index = torch.tensor(rows, device=logits.device)
            constrained = logits.index_select(0, index)
            self._xgr.apply_token_bitmask_inplace(constrained, bitmask[index], vocab_size=self.vocab_size)
            logits.index_copy_(0, index, constrained)

    def only_stops_allowed(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether ``matcher`` allows nothing next but a stop token: its grammar has ended."""
        matcher.fill_next_token_bitmask(self._probe)
        return not bool((self._probe[0] & self._not_stop).any())


class StructuredOutputRequest:
    """One sample's grammar: its compile (shared by every request with the same spec) and its own matcher."""

    def __init__(self, manager: StructuredOutputManager, future: concurrent.futures.Future) -> None:
        self.manager = manager
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.stuck = False  # the grammar allowed no token of the vocabulary (see apply_bitmask)

    def start(self) -> bool:
        """Build the matcher once the grammar is compiled; False while it compiles. Raises the compile's RequestError."""
        if self.matcher is None:
            if not self.future.done():
                return False
            self.matcher = self.manager._xgr.GrammarMatcher(self.future.result())
        return True

    def accept(self, token: int) -> bool:
        """Advance by the sampled ``token``; True when the grammar has ended (nothing but a stop token may follow)."""
        assert self.matcher is not None, "start() comes first"
        if self.stuck:
            raise RequestError(
                "its grammar requires text that no token of this model's vocabulary can write "
                "(e.g. a character whose bytes have no token); change the schema, regex, choice or grammar"
            )
        if not self.matcher.accept_token(token):
            raise RequestError(f"the sampled token {token} does not match the request's grammar")
        if self.matcher.is_terminated():
            return True
        return self.matcher.is_completed() and self.manager.only_stops_allowed(self.matcher)


def apply_grammar_bitmask(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask the logits of the rows (``logits[i]`` for ``seqs[i]``) whose request has a grammar; others untouched."""
    rows = [i for i, seq in enumerate(seqs) if seq.extra.grammar is not None]
    if rows:
        grammars = [seqs[i].extra.grammar for i in rows]
        grammars[0].manager.apply_bitmask(logits, rows, grammars)
