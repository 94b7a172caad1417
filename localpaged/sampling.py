"""SamplingParams: how a request picks its tokens, checked in full when it is built.

Torch-free on purpose: a front end (TUI, server, a script talking to the core process) builds
SamplingParams without paying for torch. The sampler that applies them lives with the runner,
in ``localpaged.engine.sampler``. Every field is validated here, so a bad value is refused with
a ConfigError naming the field at the caller, never found deep inside an engine step.
"""

from __future__ import annotations

import json as _json
import math
import numbers
from dataclasses import dataclass, field

from localpaged.errors import ConfigError
from localpaged.unicode_text import not_unicode

MAX_TOKENS_LIMIT = 1 << 20  # beyond any context we can hold: a value above it is a mistake
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1  # any 64-bit seed, as OpenAI's and vLLM's; torch takes them all
# Above any vocabulary, and within what crosses to the engine process (msgspec carries 64-bit integers):
# a bigger top_k or token id is a mistake, and would fail there rather than here.
MAX_TOKEN_ID = (1 << 31) - 1
# Temperatures below this sample greedily, as vLLM's do (its _SAMPLING_EPS): the distribution is already
# all but one-hot there, and a tiny one such as 1e-110 overflowed logits / temperature to inf, so the
# request failed with "probabilities are not finite" instead of decoding.
GREEDY_TEMPERATURE = 1e-5
# What a request may carry, so that no request's stop checks cost the step loop more than its own tokens do
# (every request's are checked on the engine core after each of its tokens). Generous against OpenAI's 4
# stop strings; a longer list of "stop words" belongs in a grammar or logit_bias.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # in one stop string
MAX_STOP_TOKEN_IDS = 64
MAX_N = 64  # parallel samples of one prompt; more are a batch of separate requests
MAX_LOGPROBS = 20  # top_logprobs, as OpenAI bounds it
MAX_LOGIT_BIAS = 1024  # tokens one request may bias; a larger set belongs in a grammar
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it
MAX_GRAMMAR_CHARS = 100_000  # the text of one schema, regex or grammar
MAX_CHOICES = 256  # strings of one ``choice``
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's reply must match; exactly one field set (vLLM's ``structured_outputs``).

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object; ``regex``: a
    regular expression; ``choice``: one of these strings; ``grammar``: an EBNF grammar (GBNF-style, as
    xgrammar reads it, with ``root`` its start rule). The engine compiles it with xgrammar before the
    request is queued, and a spec it cannot compile is a RequestError naming what it refused.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ConfigError(
                f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if not isinstance(self.json_object, bool):
            raise ConfigError(f"json_object={self.json_object!r}: use True or False")
        if self.json is not None:
            if isinstance(self.json, dict):
                try:
                    text = _json.dumps(self.json, sort_keys=True, ensure_ascii=False)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"json schema: not JSON ({exc}); use a dict of JSON values") from None
            elif isinstance(self.json, str):
                text = self.json
                try:
                    parsed = _json.loads(text)
                except ValueError as exc:
                    raise ConfigError(f"json schema: not valid JSON text ({exc})") from None
                if not isinstance(parsed, (dict, bool)):
                    raise ConfigError("json schema: a schema is a JSON object, e.g. {'type': 'object'}")
            else:
                raise ConfigError(f"json={_brief(self.json)}: use a JSON schema as a dict or as JSON text")
            _check_size("json schema", text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{name}={_brief(value)}: use a non-empty string")
                _check_size(name, value)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ConfigError(f"choice={_brief(self.choice)}: use a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ConfigError(f"choice has {len(self.choice)} strings: use at most {MAX_CHOICES}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ConfigError(f"choice={_brief(self.choice)}: every choice is a non-empty string")
            _check_size("choice", "".join(self.choice))
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by; equal specs share one compile."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = _json.dumps(self.choice)
        else:
            text = getattr(self, kind)
        return kind, text


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.7  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None  # per-request: the same seed gives the same sample, whatever else runs
    stop: list[str] = field(default_factory=list)  # strings that end the reply (not included in it)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to EOS and end-of-turn
    ignore_eos: bool = False  # keep going past EOS/end-of-turn (benchmarks)
    n: int = 1  # parallel samples of the prompt, sharing its KV blocks; each its own output (``index``)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every token already in the reply
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token is already in the reply
    repetition_penalty: float = 1.0  # HF's and llama.cpp's: divides (or multiplies) prompt and reply tokens' logits
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; 0: each chosen token's; k: and the k likeliest (the model's own)
    structured: StructuredOutputs | None = None  # a schema, regex, choice or grammar the reply must match

    def __post_init__(self) -> None:
        self.max_tokens = _whole("max_tokens", self.max_tokens, "a whole number of tokens")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens!r}: ask for at least 1 token")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise ConfigError(
                f"max_tokens={self.max_tokens}: more than any context holds; use at most {MAX_TOKENS_LIMIT}"
            )
        self.temperature = _real("temperature", self.temperature, "0 (greedy) or more, e.g. 0.7")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature!r}: must be 0 (greedy) or more, e.g. 0.7")
        self.top_k = _whole("top_k", self.top_k, "0 (off) or a positive number of tokens")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be 0 (off) or more")
        if self.top_k > MAX_TOKEN_ID:
            raise ConfigError(f"top_k={self.top_k}: more tokens than any vocabulary; use 0 to keep every token")
        self.top_p = _real("top_p", self.top_p, "a number in (0, 1]; 1 turns it off")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p!r}: must be in (0, 1]; 1 turns it off")
        if self.seed is not None:
            self.seed = _whole("seed", self.seed, f"a whole number from {MIN_SEED} to {MAX_SEED}, or none for random")
            if not MIN_SEED <= self.seed <= MAX_SEED:
                raise ConfigError(f"seed={self.seed}: use a whole number from {MIN_SEED} to {MAX_SEED} (a 64-bit seed)")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos={self.ignore_eos!r}: use True or False")
        self.n = _whole("n", self.n, f"a whole number of samples from 1 to {MAX_N}")
        if not 1 <= self.n <= MAX_N:
            raise ConfigError(f"n={self.n}: ask for 1 to {MAX_N} samples of one prompt")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "a number in [-2, 2]; 0 turns it off")
            if not -2 <= value <= 2:
                raise ConfigError(f"{name}={value!r}: must be in [-2, 2]; 0 turns it off")
            setattr(self, name, value)
        self.repetition_penalty = _real(
            "repetition_penalty", self.repetition_penalty, "a number in (0, 10]; 1 turns it off"
        )
        if not 0 < self.repetition_penalty <= 10:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty!r}: must be in (0, 10]; 1 turns it off")
        self.min_p = _real("min_p", self.min_p, "a number in [0, 1]; 0 turns it off")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p={self.min_p!r}: must be in [0, 1]; 0 turns it off")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.logprobs is not None:
            self.logprobs = _whole("logprobs", self.logprobs, f"0 to {MAX_LOGPROBS} top tokens, or none")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ConfigError(f"logprobs={self.logprobs}: ask for 0 to {MAX_LOGPROBS} top tokens, or none")
        if isinstance(self.structured, dict):  # as it crosses to the engine core
            unknown = set(self.structured) - set(STRUCTURED_KINDS)
            if unknown:
                raise ConfigError(
                    f"structured={_brief(self.structured)}: unknown field {min(unknown)!r}; "
                    f"use one of {', '.join(STRUCTURED_KINDS)}"
                )
            self.structured = StructuredOutputs(**self.structured)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ConfigError(
                f"structured={_brief(self.structured)}: use StructuredOutputs(json=...), (regex=...), "
                "(choice=[...]), (grammar=...) or (json_object=True)"
            )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (or below GREEDY_TEMPERATURE), or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Any of the penalties or a logit bias is set: the row's logits change before it is sampled."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


def _whole(name: str, value: object, use: str) -> int:
    """``value`` as an int; numpy integers pass, while bools and floats (even 3.0) are refused as likely mistakes."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name}={value!r}: must be {use}, not {type(value).__name__}")
    return int(value)


def _real(name: str, value: object, use: str) -> float:
    """``value`` as a finite float; ints and numpy floats pass, bools, strings and NaN/inf do not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name}={value!r}: must be {use}, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{name}={value!r}: must be a finite number, {use}")
    return number


def _stop_strings(stop: object) -> list[str]:
    """One stop string or a list/tuple of them, as a list without empty strings (an empty one would stop at once)."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop={_brief(stop)}: use a string or a list of strings, e.g. stop=['\\n\\n']")
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"stop has {len(stop)} strings: use at most {MAX_STOP_STRINGS}")
    if not all(isinstance(s, str) for s in stop):
        raise ConfigError(f"stop={_brief(stop)}: use a string or a list of strings, e.g. stop=['\\n\\n']")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        longest = max(len(s) for s in stop)
        raise ConfigError(f"a stop string has {longest} characters: use at most {MAX_STOP_CHARS} in each")
    for s in stop:
        if reason := not_unicode(s):
            raise ConfigError(f"stop={stop!r}: {reason}")
    return [s for s in stop if s]


def _token_ids(ids: object) -> list[int]:
    """A list/tuple of token ids as a list of ints; the vocabulary bound is checked by the engine that knows it."""
    if isinstance(ids, (list, tuple)) and len(ids) > MAX_STOP_TOKEN_IDS:
        raise ConfigError(f"stop_token_ids has {len(ids)} ids: use at most {MAX_STOP_TOKEN_IDS}")
    if not isinstance(ids, (list, tuple)) or any(
        isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t <= MAX_TOKEN_ID for t in ids
    ):
        raise ConfigError(
            f"stop_token_ids={_brief(ids)}: use a list of token ids (whole numbers from 0 to {MAX_TOKEN_ID})"
        )
    return [int(t) for t in ids]


def _logit_bias(bias: object) -> dict[int, float]:
    """Token id -> bias in [-100, 100]; ids may come as strings (JSON object keys are strings)."""
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias={_brief(bias)}: use a dict of token id -> bias, e.g. {{50256: -100}}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ConfigError(f"logit_bias has {len(bias)} tokens: bias at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token <= MAX_TOKEN_ID:
            raise ConfigError(f"logit_bias key {key!r}: use token ids (whole numbers from 0 to {MAX_TOKEN_ID})")
        number = _real("logit_bias", value, f"a bias from -{LOGIT_BIAS_RANGE:g} to {LOGIT_BIAS_RANGE:g}")
        if not -LOGIT_BIAS_RANGE <= number <= LOGIT_BIAS_RANGE:
            raise ConfigError(
                f"logit_bias[{key!r}]={value!r}: must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
            )
        out[int(token)] = number
    return out


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ConfigError(f"the {name} has {len(text)} characters: use at most {MAX_GRAMMAR_CHARS}")


def _brief(value: object) -> str:
    """``repr(value)``, cut short: a message quotes what was sent, never megabytes of it."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
