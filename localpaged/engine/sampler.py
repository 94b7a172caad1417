"""The sampler: turns a step's logits into one token per finishing sequence, per its SamplingParams.

Lives with the runner (not with SamplingParams) so that building SamplingParams never imports
torch. A row whose sampling fails hands back its exception in place of a token, so the failure
ends that row's request alone and every other request in the batch goes on.
"""

from __future__ import annotations

import hashlib
import os

import torch

from localpaged.engine.sequence import Sequence
from localpaged.sampling import SamplingParams


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


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
    """One token per row of ``logits`` ``[S, vocab]``, row i for ``seqs[i]`` (its params, its generator in
    ``seq.extra``): greedy rows in one argmax, others row by row.

    A non-greedy row that fails gets its exception instead of a token: it concerns that request only.
    """
    out: list[int | Exception] = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p: SamplingParams = seq.params
        if not p.greedy:
            try:
                out[i] = _sample_row(logits[i].float(), p, seq.extra.generator)
            except Exception as exc:  # noqa: BLE001 -- handed to the row's request, which fails alone
                out[i] = exc
    return out


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
