"""Llama 3.x RoPE scaling: transformers' frequencies, greedy parity past the original context, and a GGUF's
``rope_freqs`` tensor (llama.cpp's per-dimension divisors) giving the same model."""

from __future__ import annotations

import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.layers.rotary_embedding import rope_frequencies
from tests.conftest import save_hf_folder
from tests.gguf_models import tiny_hf_model, write_gguf
from tests.oracle import assert_same_greedy, hf_greedy

ORIGINAL = 64  # the original context of these tiny models: the prompts below run well past it
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
}
PROMPTS = [list(range(100, 100 + 3 * ORIGINAL)), list(range(2000, 2000 + ORIGINAL + 10)), [1]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama3_model():
    return tiny_hf_model("llama", rope=LLAMA3, max_positions=1024)


def _hf_frequencies(config, seq_len: int | None = None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu", seq_len=seq_len)


def test_llama3_frequencies_equal_transformers(llama3_model):
    ours, scale = rope_frequencies(llama3_model.config, 64, 1024)
    theirs, their_scale = _hf_frequencies(llama3_model.config)
    assert scale == their_scale == 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)  # ours in float64, rounded once
    assert (ours < 1.0 / (10000.0 ** (torch.arange(0, 64, 2) / 64)) * 0.99).any()  # some frequencies really scaled


def test_longrope_frequencies_and_attention_factor_equal_transformers():
    from tests.engine.test_phi3 import LONGROPE

    config = tiny_hf_model("phi3", rope=LONGROPE, max_positions=1024).config
    original = LONGROPE["original_max_position_embeddings"]
    for max_positions, seq_len in ((original, None), (4 * original, original + 1)):
        ours, scale = rope_frequencies(config, 64, max_positions)
        theirs, their_scale = _hf_frequencies(config, seq_len)
        assert torch.equal(ours, theirs) and scale == their_scale and len(ours) == 24


def test_tiny_llama_with_llama3_scaling_matches_transformers_past_the_original_context(
    tmp_path, llama3_model, default_model_folder
):
    llm = LLM(str(save_hf_folder(llama3_model, tmp_path / "llama3", default_model_folder)), dtype="float32",
              kv_cache_dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=512)  # fmt: skip
    for i, (out, prompt) in enumerate(zip(llm.generate(PROMPTS, GREEDY), PROMPTS)):
        want, gaps = hf_greedy(llama3_model, prompt, GREEDY.max_tokens)
        assert_same_greedy(out.token_ids, want, gaps, f"llama3 prompt {i}")


def test_a_gguf_rope_freqs_tensor_divides_the_frequencies_as_llama_cpp_does(tmp_path, llama3_model, gguf_tokenizer):
    """Float tensors, so the oracle is the transformers model the file was written from: transformers reads
    no RoPE scaling from a GGUF (its GGUF config has none), llama.cpp and we read ``rope_freqs``."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {"token_embd.weight": "F32", "output.weight": "F32"}
    types.update({f"blk.{i}.{n}.weight": "F32" for i in range(2) for n in names})
    path = write_gguf(tmp_path / "llama3.gguf", llama3_model, "llama", types, gguf_tokenizer)
    llm = LLM(
        str(path), dtype="float32", kv_cache_dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=512
    )
    config = llm.runner.model.config
    assert len(config.rope_freq_factors) == 32
    torch.testing.assert_close(rope_frequencies(config, 64, 512)[0], _hf_frequencies(llama3_model.config)[0])
    for i, (out, prompt) in enumerate(zip(llm.generate(PROMPTS, GREEDY), PROMPTS)):
        want, gaps = hf_greedy(llama3_model, prompt, GREEDY.max_tokens)
        assert_same_greedy(out.token_ids, want, gaps, f"llama3 gguf prompt {i}")
