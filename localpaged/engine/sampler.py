"""The sampler: turns a step's logits into one token per finishing sequence, per its SamplingParams.

Lives with the runner (not with SamplingParams) so that building SamplingParams never imports
torch. A row whose sampling fails hands back its exception in place of a token, so the failure
ends that row's request alone and every other request in the batch goes on.

Order, as vLLM v1's: the log-probabilities a request asked for come from the raw logits; then
logit_bias, repetition_penalty, presence and frequency penalties change the logits (greedy rows
take the argmax after them); then, for sampled rows, min_p, temperature, top-k, top-p. Each feature
is one batched pass over the rows that ask for it, so a row that asks for none takes the plain path
unchanged and its tokens are bit-identical to a step without any of them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from localpaged.engine.output import TokenLogprob
from localpaged.engine.sequence import Sequence
from localpaged.kernels import cpu
from localpaged.sampling import SamplingParams


@dataclass
class SampledToken:
    """One row's choice: the token, and its log-probabilities when the request asked for them."""

    token_id: int
    logprob: TokenLogprob | None = None


def make_generator(params: SamplingParams, device: torch.device, index: int = 0) -> torch.Generator | None:
    """Sample ``index``'s own random stream, so its tokens do not depend on what else runs; None when greedy.

    Seeded, sample 0 draws from ``seed`` itself (so it is the stream of the same request with n = 1) and
    sample i > 0 from a seed derived from (seed, i) by SHA-256: reproducible, and unrelated to the streams
    of other seeds (seed + i would make sample 1 of seed s sample 0 of seed s + 1).
    """
    if params.greedy:
        return None
    if params.seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    elif index == 0:
        seed = params.seed
    else:
        digest = hashlib.sha256(f"localpaged-sample:{params.seed}:{index}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sample(
    logits: torch.Tensor, seqs: list[Sequence], mask: Callable[[torch.Tensor], None] | None = None
) -> list[SampledToken | Exception]:
    """One token per row of ``logits`` ``[S, vocab]``, row i for ``seqs[i]`` (its params, its generator in
    ``seq.extra``), with its logprobs where asked: logprobs, bias, penalties and min_p each in one batched
    pass over the rows that ask, greedy rows in one argmax, others drawn from their own generators (on the CPU in
    native calls over all of them: ``draw_rows``; the rest row by row).

    ``mask`` (a grammar's bitmask) changes ``logits`` in place once the raw logprobs are taken, before
    anything else: logprobs are the model's own distribution, and a masked token stays out whatever its bias.
    A non-greedy row that fails gets its exception instead of a token: it concerns that request only.
    ``logits`` is the sampler's to change: the rows that ask for bias, penalties or min_p may change in place.
    """
    params: list[SamplingParams] = [seq.params for seq in seqs]
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
    if mask is not None:
        mask(logits)
    if any(p.penalized for p in params):
        logits = logits.contiguous()  # a copy only where the model's logits are a view: its rows are indexed flat
        apply_penalties(logits, seqs)
    apply_min_p(logits, params)
    tokens: list[int | Exception] = greedy_indices(logits).tolist()
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    fast = draw_rows(logits, drawn, [params[i] for i in drawn], [seqs[i].extra.generator for i in drawn])
    for i, token in zip(drawn, fast):
        try:
            tokens[i] = token if token is not None else _cut_row(logits[i].float(), params[i], seqs[i].extra.generator)
        except Exception as exc:  # noqa: BLE001 -- handed to the row's request, which fails alone
            tokens[i] = exc
    out: list[SampledToken | Exception] = [t if isinstance(t, Exception) else SampledToken(t) for t in tokens]
    if raw_logprobs is not None:
        for i, logprob in zip(logprob_rows, token_logprobs(raw_logprobs, [tokens[i] for i in logprob_rows], params)):
            if isinstance(out[i], SampledToken):
                out[i].logprob = logprob
    return out


def greedy_indices(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest logit (a NaN's, if it has one): the native kernel where the CPU
    kernels run (torch's indexed reduction over a step's fresh logits took several times longer), else max's
    indices, not argmax: the same index, several times faster than argmax on the CPU."""
    if cpu.runs(logits.device, logits.dtype):
        return cpu.argmax_rows(logits)
    return logits.max(dim=-1).indices


def token_logprobs(
    raw_logprobs: torch.Tensor, tokens: list[int | Exception], params: list[SamplingParams]
) -> list[TokenLogprob | None]:
    """Per row of ``raw_logprobs`` (the log-softmax of those rows' raw logits): the chosen token's and the
    ``logprobs`` likeliest, in one gather and one top-k for the rows together; None where sampling failed."""
    chosen_ids = torch.tensor([t if isinstance(t, int) else 0 for t in tokens], device=raw_logprobs.device)
    chosen = raw_logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    ks = [p.logprobs for p in params if p.logprobs is not None]
    k = min(max(ks), raw_logprobs.shape[-1])
    top_values, top_ids = ([], []) if k == 0 else (t.tolist() for t in torch.topk(raw_logprobs, k, dim=-1))
    wanted = iter(ks)
    out: list[TokenLogprob | None] = []
    for row, token in enumerate(tokens):
        n = next(wanted)
        if isinstance(token, Exception):
            out.append(None)
            continue
        top = list(zip(top_ids[row][:n], top_values[row][:n])) if n else []
        out.append(TokenLogprob(token_id=token, logprob=chosen[row], top=top))
    return out


class TokenHistory:
    """One request's prompt and reply ids on the device, for its penalties: kept in ``seq.extra.history`` from
    step to step and grown by the tokens appended since, so a step costs each request its new tokens rather
    than its whole context. Past ``length`` it holds the request's first token, a harmless pad (see below)."""

    def __init__(self, seq: Sequence, device: torch.device) -> None:
        self.pad = seq.token_ids[0]
        self.ids = torch.full((max(64, 2 * seq.num_tokens),), self.pad, device=device)
        self.ids[: seq.num_tokens] = torch.tensor(seq.token_ids, device=device)
        self.length = seq.num_tokens

    @classmethod
    def of(cls, seq: Sequence, device: torch.device) -> TokenHistory:
        """``seq``'s history, made at its first penalized step and brought up to its tokens so far."""
        history = seq.extra.history
        if history is None:
            history = seq.extra.history = cls(seq, device)
        new = seq.token_ids[history.length :]
        if new:
            history.reserve(seq.num_tokens)
            history.ids[history.length : seq.num_tokens] = torch.tensor(new, device=device)
            history.length = seq.num_tokens
        return history

    def reserve(self, width: int) -> None:
        """Room for ``width`` ids (doubling, so growing costs each token once on average)."""
        if width > len(self.ids):
            grown = torch.full((max(width, 2 * len(self.ids)),), self.pad, device=self.ids.device)
            grown[: self.length] = self.ids[: self.length]
            self.ids = grown


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply each row's logit_bias and penalties to ``logits`` (contiguous) in place; rows without any are
    not touched.

    logit_bias adds to its tokens' logits; repetition_penalty (HF's, llama.cpp's) divides the positive
    and multiplies the negative logits of every token in the prompt or the reply so far; presence and
    frequency penalties (OpenAI's) subtract ``presence * (count > 0) + frequency * count`` over the reply's
    tokens. Every pass gathers and scatters only the logits of the tokens a row holds (flat indices over the
    rows' ``TokenHistory``), never a whole vocabulary row: at 64 requests that is far cheaper than count
    tensors over the vocabulary (benchmarks/sampling_cost.py times both).
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
    if not rows:
        return
    dev, vocab, flat_logits = logits.device, logits.shape[-1], logits.view(-1)
    bias = [(i * vocab + token, value) for i in rows for token, value in seqs[i].params.logit_bias.items()]
    if bias:
        at, value = zip(*bias)
        flat_logits.scatter_add_(0, torch.tensor(at, device=dev), torch.tensor(value, dtype=logits.dtype, device=dev))
    rep = [i for i in rows if seqs[i].params.repetition_penalty != 1]
    if rep:
        # The pad is each row's first token: the penalized value it writes is the one that token gets anyway.
        ids, at, _ = _histories([seqs[i] for i in rep], rep, vocab, dev)
        penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rep], device=dev).unsqueeze(1)
        score = flat_logits.gather(0, at.view(-1)).view_as(at)
        flat_logits.scatter_(0, at.view(-1), torch.where(score < 0, score * penalty, score / penalty).view(-1))
    counted = [i for i in rows if seqs[i].params.presence_penalty or seqs[i].params.frequency_penalty]
    if counted:
        picked = [seqs[i] for i in counted]
        ids, at, positions = _histories(picked, counted, vocab, dev)
        start = torch.tensor([seq.num_prompt_tokens for seq in picked], device=dev).unsqueeze(1)
        end = torch.tensor([seq.num_tokens for seq in picked], device=dev).unsqueeze(1)
        reply = (positions >= start) & (positions < end)
        frequency = torch.tensor([seq.params.frequency_penalty for seq in picked], device=dev).unsqueeze(1)
        presence = torch.tensor([seq.params.presence_penalty for seq in picked], device=dev).unsqueeze(1)
        flat_logits.scatter_add_(0, at.view(-1), (-frequency * reply).to(logits.dtype).view(-1))
        # Presence once per token: every place of a token writes the same value (read after the frequency pass),
        # and places outside the reply write to the reply's first token, whose value they then agree with.
        first = ids.gather(1, start.clamp(max=ids.shape[1] - 1))
        target = torch.where(reply, at, at - ids + first).view(-1)
        value = flat_logits.gather(0, target).view_as(at) - presence * reply.any(dim=1, keepdim=True)
        flat_logits.scatter_(0, target, value.to(logits.dtype).view(-1))


def _histories(
    seqs: list[Sequence], rows: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences' ids, one row each padded to the longest; their flat indices into the logits (row ``rows[i]``);
    and each column's position."""
    histories = [TokenHistory.of(seq, device) for seq in seqs]
    width = max(seq.num_tokens for seq in seqs)
    for history in histories:
        history.reserve(width)
    ids = torch.stack([history.ids[:width] for history in histories])
    at = ids + torch.tensor(rows, device=device).unsqueeze(1) * vocab
    return ids, at, torch.arange(width, device=device).unsqueeze(0)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Set to -inf, in place, the logits of the tokens each sampled row's min_p drops: those whose probability
    (after temperature) is below min_p times the likeliest's. Greedy rows skip it (the argmax is always kept)."""
    rows = [i for i, p in enumerate(params) if p.min_p and not p.greedy]
    if not rows:
        return
    dev = logits.device
    temperature = torch.tensor([params[i].temperature for i in rows], device=dev).unsqueeze(1)
    min_p = torch.tensor([params[i].min_p for i in rows], device=dev).unsqueeze(1)
    sub = logits[rows].float()
    probs = torch.softmax(sub / temperature, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    logits[rows] = sub.masked_fill(drop, float("-inf")).to(logits.dtype)


def draw_rows(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | Exception | None]:
    """Sampled rows ``rows`` of float32 ``logits`` [S, vocab], at ``params[j]`` with a key from ``generators[j]``, all
    in one native call on the CPU kernels (``cpu.nucleus_rows``): of each row's ``logits / temperature``, its top_k
    largest, of those the likeliest that its top_p keeps (the smallest set, in descending order, whose share of their
    probability reaches it), then the exponential race of ``draw`` among them, taken in logs (a row with neither is
    the race over the whole vocabulary, with no softmax first). A row with a NaN or +inf gets its error; None for a
    row the call leaves (another device, or a set wider than the kernel looks: a flat row at a high top_p, a top_k
    over 2,048), which goes row by row (``_cut_row``), its generator one key on. A row depends on its own logits and
    key alone, so a request draws the same alone or batched; one row alone (``_sample_row``) runs this same code."""
    if not rows or not cpu.runs(logits.device, logits.dtype):
        return [None] * len(rows)
    sub = logits if rows == list(range(len(logits))) else logits[rows]
    scale = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    keys = torch.cat([_key(g) for g in generators])
    tokens = cpu.nucleus_rows(sub, scale, top_p, top_k, keys).tolist()
    return [None if t == cpu.UNDECIDED else t if t >= 0 else not_finite(p.temperature) for t, p in zip(tokens, params)]


def not_finite(temperature: float) -> ValueError:
    """The error of a row whose probabilities are not finite."""
    return ValueError(
        f"the next-token probabilities are not finite (NaN or infinite logits at temperature={temperature}); "
        "greedy decoding (temperature=0) does not sample from them"
    )


def _key(generator: torch.Generator | None) -> torch.Tensor:
    """The next 64 random bits of a row's stream, a race's key: int64 [1]."""
    return torch.randint(-(2**63), 2**63 - 1, (1,), generator=generator)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One draw from ``logits`` after temperature, top-k and top-p: what ``sample`` draws for the row in any batch
    (``draw_rows``, else ``_cut_row``)."""
    token = draw_rows(logits[None], [0], [p], [generator])[0]
    if isinstance(token, Exception):
        raise token
    return token if token is not None else _cut_row(logits, p, generator)


def _cut_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One draw from ``logits`` after temperature, top-k and top-p, row by row. With top-k the draw is among the k
    likeliest alone (in descending order, as top-p wants them): no pass over the whole vocabulary after the top-k."""
    candidates = None
    if p.top_k and p.top_k < logits.numel():
        logits, candidates = torch.topk(logits, p.top_k)
    probs = torch.softmax(logits / p.temperature, dim=-1)
    # Checked here, not left to multinomial: on CUDA it asserts inside the kernel, which kills the whole context.
    if not torch.isfinite(probs.sum()):
        raise not_finite(p.temperature)
    if p.top_p < 1:
        if candidates is None:
            probs, candidates = likeliest(probs, p.top_p)
        drop = probs.cumsum(0) - probs > p.top_p  # keep the smallest set reaching top_p
        probs = probs.masked_fill(drop, 0.0)
    token = draw(probs, generator)
    return token if candidates is None else int(candidates[token])


def likeliest(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs``' likeliest values and their indices, in descending order, as many as top-p can keep: a top-k of 64,
    then 512, 4,096, ... until their running sum passes ``top_p`` (the next token is then dropped, and every one
    after it), a sort of the whole vocabulary only where that many do not. The running sum is the one top-p then
    takes, so the tokens kept are the sort's (of equal values, either may come first, as in a sort); a small top-k
    costs a fraction of a sort of a whole vocabulary."""
    k = 64
    while k < len(probs) // 4:
        top, ids = torch.topk(probs, k)
        if float(top.cumsum(0)[-1]) > top_p:
            return top, ids
        k *= 8
    return probs.sort(descending=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index of ``probs`` (1-D, non-negative, finite, not all 0) drawn with its probability: the exponential race
    torch.multinomial runs (the largest p / E over independent exponentials E), whose winner a rounding-size change
    in ``probs`` moves only where two ratios all but tie, so a request draws the same tokens alone or batched. On the
    CPU kernels it is ``cpu.race_rows`` on ln(p), as ``draw_rows`` draws; elsewhere E is -log of
    torch.rand's uniforms (multinomial's own exponentials took several times longer). A uniform of 0 makes E
    infinite and its token's ratio 0: it loses."""
    if cpu.runs(probs.device, torch.float32):
        token = int(cpu.race_rows(torch.log(probs.float())[None], torch.ones(1), _key(generator))[0])
    else:
        race_ratios = probs.float() / -torch.log(torch.rand(probs.shape, generator=generator, device=probs.device))
        token = int(greedy_indices(race_ratios[None])[0])
    return token if token >= 0 and probs[token] > 0 else int(probs.argmax())  # every token drew an infinite E
