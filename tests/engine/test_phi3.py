"""Phi-3 family: fused qkv and gate_up checkpoints, partial rotary and LongRoPE, on parity with transformers.

A safetensors folder checks the model against transformers' own Phi-3 code; GGUF files check that the
fused tensors stay blocks and that the RoPE settings transformers does not read from a GGUF (rotary
dimensions, LongRoPE's factor tensors) are read as llama.cpp reads them.
"""

from __future__ import annotations

import numpy as np
import pytest

from localpaged import LLM, SamplingParams
from tests.conftest import save_hf_folder
from tests.gguf_models import tiny_hf_model, write_gguf
from tests.oracle import assert_same_greedy, exact_llm, hf_greedy, load_hf

ORIGINAL = 128  # LongRoPE's original context in these tiny models
# Phi-4-mini's shape of RoPE: 0.75 of each head rotated, LongRoPE factors for 24 of its 32 frequency pairs.
LONGROPE = {
    "rope_type": "longrope",
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": ORIGINAL,
    "short_factor": np.linspace(1.0, 1.6, 24).tolist(),
    "long_factor": np.linspace(1.0, 9.0, 24).tolist(),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def longrope_phi3():
    return tiny_hf_model("phi3", rope=LONGROPE, max_positions=1024)


def _check(llm: LLM, hf, prompts: list[list[int]], label: str) -> None:
    for i, (out, prompt) in enumerate(zip(llm.generate(prompts, GREEDY), prompts)):
        want, gaps = hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert_same_greedy(out.token_ids, want, gaps, f"{label} prompt {i}")


def _short_prompts(llm: LLM) -> list[list[int]]:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    return [[1], list(chat["input_ids"]), list(range(100, 150))]


LONG_PROMPTS = [list(range(100, 100 + ORIGINAL + 40)), list(range(3000, 3000 + 2 * ORIGINAL))]


def test_tiny_phi3_with_partial_rotary_and_longrope_matches_transformers(tmp_path, longrope_phi3, default_model_folder):
    folder = save_hf_folder(longrope_phi3, tmp_path / "phi3", default_model_folder)
    within = exact_llm(folder, max_model_len=ORIGINAL)  # short factors, as transformers within the original context
    _check(within, longrope_phi3, _short_prompts(within), "phi3 short factors")
    del within
    # Past the original context: long factors at every position, as transformers for a sequence that starts there.
    _check(exact_llm(folder, max_model_len=512), longrope_phi3, LONG_PROMPTS, "phi3 long factors")


def test_a_phi3_gguf_keeps_its_fused_projections_as_blocks_and_matches_transformers(tmp_path, gguf_tokenizer):
    from localpaged.kernels import cpu
    from localpaged.layers.linear import BlockLinear

    types = {"blk.0.attn_qkv.weight": "Q4_K", "blk.0.ffn_up.weight": "Q6_K", "blk.1.attn_qkv.weight": "Q5_0"}
    path = write_gguf(tmp_path / "tiny-phi3.gguf", tiny_hf_model("phi3"), "phi3", types, gguf_tokenizer)
    llm = exact_llm(path, max_model_len=512)
    layer = llm.runner.model.layers[0]
    if cpu.library() is not None:
        assert isinstance(layer.self_attn.qkv_proj, BlockLinear) and isinstance(layer.mlp.gate_up_proj, BlockLinear)
        assert layer.self_attn.qkv_proj.packed.group == 32 and layer.mlp.gate_up_proj.packed.group == 16
    _check(llm, load_hf(path), _short_prompts(llm), "phi3 gguf")


def test_a_phi3_gguf_reads_partial_rotary_and_longrope_from_the_file(tmp_path, gguf_tokenizer, longrope_phi3):
    """Float tensors: the same weights as the transformers model it was written from (transformers itself
    reads no LongRoPE from a GGUF, so that model is the oracle)."""
    projections = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
    types = {name: "F32" for name in ("token_embd.weight", "output.weight")}
    types.update({f"blk.{i}.{p}.weight": "F32" for i in range(2) for p in projections})
    path = write_gguf(tmp_path / "longrope-phi3.gguf", longrope_phi3, "phi3", types, gguf_tokenizer)
    within = exact_llm(path, max_model_len=ORIGINAL)
    rope = within.runner.model.config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    assert np.allclose(rope["long_factor"], LONGROPE["long_factor"])
    _check(within, longrope_phi3, _short_prompts(within), "phi3 gguf short factors")
    del within
    _check(exact_llm(path, max_model_len=512), longrope_phi3, LONG_PROMPTS, "phi3 gguf long factors")
