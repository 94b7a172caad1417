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
from dataclasses import dataclass

import torch

from localpaged.engine.output import TokenLogprob
from localpaged.engine.sequence import Sequence
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


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken | Exception]:
    """One token per row of ``logits`` ``[S, vocab]``, row i for ``seqs[i]`` (its params, its generator in
    ``seq.extra``): greedy rows in one argmax, others row by row.

    A non-greedy row that fails gets its exception instead of a token: it concerns that request only.
    ``logits`` is the sampler's to change: the rows that ask for bias, penalties or min_p change in place.
    """
    params: list[SamplingParams] = [seq.params for seq in seqs]
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
    apply_penalties(logits, seqs)
    apply_min_p(logits, params)
    tokens: list[int | Exception] = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = params[i]
        if not p.greedy:
            try:
                tokens[i] = _sample_row(logits[i].float(), p, seq.extra.generator)
            except Exception as exc:  # noqa: BLE001 -- handed to the row's request, which fails alone
                tokens[i] = exc
    out: list[SampledToken | Exception] = [t if isinstance(t, Exception) else SampledToken(t) for t in tokens]
    if raw_logprobs is not None:
        for i, logprob in zip(logprob_rows, token_logprobs(raw_logprobs, [tokens[i] for i in logprob_rows], params)):
            if isinstance(out[i], SampledToken):
                out[i].logprob = logprob
    return out


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


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply each row's logit_bias and penalties to ``logits`` in place; rows without any are not touched.

    logit_bias adds to its tokens' logits; repetition_penalty (HF's, llama.cpp's) divides the positive
    and multiplies the negative logits of every token in the prompt or the reply so far; presence and
    frequency penalties (OpenAI's) subtract ``presence * (count > 0) + frequency * count`` over the reply's
    token counts. Counts come from one scatter_add over the padded reply ids of the rows that need them.
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
    if not rows:
        return
    dev = logits.device
    picked = [seqs[i] for i in rows]
    sub = logits[rows].float()  # the rows' copy, written back once
    bias = [(j, token, value) for j, seq in enumerate(picked) for token, value in seq.params.logit_bias.items()]
    if bias:
        r, t, v = zip(*bias)
        index = (torch.tensor(r, device=dev), torch.tensor(t, device=dev))
        sub.index_put_(index, torch.tensor(v, dtype=sub.dtype, device=dev), accumulate=True)
    rep = [j for j, seq in enumerate(picked) if seq.params.repetition_penalty != 1]
    if rep:
        # Padded with each row's own first token: a repeated id scatters the same value twice, harmlessly.
        ids = _padded([picked[j].token_ids for j in rep], [picked[j].token_ids[0] for j in rep], dev)
        penalty = torch.tensor([picked[j].params.repetition_penalty for j in rep], device=dev).unsqueeze(1)
        part = sub[rep]
        score = part.gather(1, ids)
        part.scatter_(1, ids, torch.where(score < 0, score * penalty, score / penalty))
        sub[rep] = part
    counted = [j for j, seq in enumerate(picked) if seq.params.presence_penalty or seq.params.frequency_penalty]
    if counted and (width := max(picked[j].num_output_tokens for j in counted)):
        outputs = [picked[j].output_token_ids for j in counted]
        ids = _padded(outputs, [0] * len(counted), dev, width)
        real = torch.arange(width, device=dev) < torch.tensor([len(o) for o in outputs], device=dev).unsqueeze(1)
        counts = torch.zeros(len(counted), sub.shape[-1], device=dev).scatter_add_(1, ids, real.float())
        presence = torch.tensor([picked[j].params.presence_penalty for j in counted], device=dev).unsqueeze(1)
        frequency = torch.tensor([picked[j].params.frequency_penalty for j in counted], device=dev).unsqueeze(1)
        sub[counted] -= presence * (counts > 0) + frequency * counts
    logits[rows] = sub.to(logits.dtype)


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


def _padded(rows: list[list[int]], pad: list[int], device: torch.device, width: int | None = None) -> torch.Tensor:
    """``rows`` as one int64 tensor, row i padded to ``width`` (the longest) with ``pad[i]``."""
    width = width or max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (width - len(r)) for r, fill in zip(rows, pad)], device=device)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # Checked here, not left to multinomial: on CUDA it asserts inside the kernel, which kills the whole context.
    if not torch.isfinite(probs.sum()):
        raise ValueError(
            f"the next-token probabilities are not finite (NaN or infinite logits at temperature={p.temperature}); "
            "greedy decoding (temperature=0) does not sample from them"
        )
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
