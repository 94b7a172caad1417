"""Hugging Face transformers as the oracle: greedy tokens, and how close each choice was to a tie."""

from __future__ import annotations

from pathlib import Path

import torch

TIE = 1e-3  # a divergence is forgiven only where HF's two best logits are closer than this


def load_hf(path: Path):
    """A Hugging Face folder, or a GGUF file read by transformers itself (gguf-py dequantises it to float32)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation with a KV cache, and per step the gap between the top two logits."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    tokens, gaps = [], []
    for _ in range(max_new_tokens):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2).values
        token = int(logits.argmax())
        tokens.append(token)
        gaps.append(float(top[0] - top[1]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, gaps


def assert_same_greedy(ours: list[int], theirs: list[int], gaps: list[float], label: str = "") -> None:
    """Token-for-token equality; a divergence passes only at a genuine tie, and comparison stops there."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert gaps[i] < TIE, (
                f"{label}: token {i} differs ({a} vs HF {b}) and HF's top-2 gap {gaps[i]:.2e} is no tie"
            )
            return
    assert len(ours) == len(theirs), f"{label}: {len(ours)} tokens vs HF {len(theirs)}"


def exact_llm(path: Path, max_model_len: int = 512, **config):
    """Our engine on the exact path (float32 weights and KV, on the CPU): the one compared with transformers."""
    from localpaged import LLM

    return LLM(
        str(path),
        dtype="float32",
        kv_cache_dtype="float32",
        activations="float32",
        device="cpu",
        kv_cache_memory="64MiB",
        max_model_len=max_model_len,
        **config,
    )
