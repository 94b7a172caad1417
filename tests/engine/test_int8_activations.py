"""int8 activations (``activations``): a GGUF's blocks take each matmul's input rounded to int8 per run, as llama.cpp
does; greedy output stays close to the exact path's (float32 activations), which the parity tests run."""

from __future__ import annotations

import pytest
import torch
from localpaged.kernels import cpu

from localpaged import LLM, SamplingParams
from localpaged.errors import ConfigError
from localpaged.layers.linear import BlockLinear
from tests.engine.test_parity import _prompts
from tests.oracle import exact_llm

pytestmark = pytest.mark.skipif(not cpu.int8_is_fast(), reason="no native kernels or no AVX-512 VNNI: int8 is refused")


def first_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of each prompt's first generated token."""
    seen: list[torch.Tensor] = []
    model = llm.runner.model
    real = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    try:
        for prompt in prompts:
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        del model.compute_logits
    return [logits[0] for logits in seen]


def test_int8_activations_pack_every_block_for_the_int8_kernel_and_stay_near_the_exact_logits(native_llama):
    exact = exact_llm(native_llama, max_model_len=1024)
    llm = LLM(
        str(native_llama),
        dtype="float32",
        kv_cache_dtype="float32",
        activations="int8",
        kv_cache_memory="64MiB",
        max_model_len=1024,
    )
    assert llm.config.activations == "int8" and exact.config.activations == "float32"
    blocks = [m for m in llm.runner.model.modules() if isinstance(m, BlockLinear)]
    assert blocks and all(m.packed.int8_activations for m in blocks)
    assert llm.runner.native_decode is not None  # decode steps in one native call, on the int8 kernel
    assert llm.kv_disk.layout.fingerprint != exact.kv_disk.layout.fingerprint  # their KV values differ
    # How far the logits move, as an RMS over their standard deviation: measured 0.03-0.17 over the parity prompts
    # (the default model: 0.08-0.35, see engine/setup.py); a kernel reading the wrong weights gives ~1.4.
    prompts = _prompts(llm.tokenizer)
    for i, (ours, want) in enumerate(zip(first_logits(llm, prompts), first_logits(exact, prompts))):
        moved = float((ours - want).pow(2).mean().sqrt() / want.std())
        assert 0 < moved < 0.3, f"prompt {i}: the logits moved by {moved:.3g} of their spread"


def test_int8_is_refused_where_it_cannot_pay(native_llama, tiny_model_path, monkeypatch):
    assert LLM(str(native_llama), dtype="float32", kv_cache_memory="64MiB", max_model_len=512).config.activations == (
        "float32"
    )  # the default: the exact path
    for model, config in ((native_llama, {"weights": "float"}), (tiny_model_path, {})):
        with pytest.raises(ConfigError, match="activations='int8' applies to a GGUF's blocks"):
            LLM(str(model), dtype="float32", activations="int8", kv_cache_memory="64MiB", max_model_len=512, **config)
    with pytest.raises(ConfigError, match="activations='int4': use 'float32'"):
        LLM(str(native_llama), activations="int4")
    monkeypatch.setattr(cpu, "int8_is_fast", lambda: False)  # a CPU without AVX-512 VNNI
    with pytest.raises(ConfigError, match="activations='int8' needs a CPU with AVX-512 VNNI"):
        LLM(str(native_llama), dtype="float32", activations="int8", kv_cache_memory="64MiB", max_model_len=512)
