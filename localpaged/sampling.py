"""SamplingParams: how a request picks its tokens, checked in full when it is built.

Torch-free on purpose: a front end (TUI, server, a script talking to the core process) builds
SamplingParams without paying for torch. The sampler that applies them lives with the runner,
in ``localpaged.engine.sampler``. Every field is validated here, so a bad value is refused with
a ConfigError naming the field at the caller, never found deep inside an engine step.
"""

from __future__ import annotations

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

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 (or below GREEDY_TEMPERATURE), or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


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


def _brief(value: object) -> str:
    """``repr(value)``, cut short: a message quotes what was sent, never megabytes of it."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
