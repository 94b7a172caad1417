"""benchmarks/random_gguf.py --shape: another shape's dimensions and family layout under the source's tokenizer
(resized to the shape's vocabulary), llama.cpp's types written as random blocks; it loads on the native kernels
and decodes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, dequantize
from random_gguf import Shape, mix_type, write_shaped_gguf

from localpaged import LLM, SamplingParams

SHAPE = Shape(hidden=512, layers=2, heads=8, kv_heads=2, intermediate=1024, tied=False)


def test_a_custom_shape_gets_its_dimensions_the_q4_k_m_types_and_runs_natively(tiny_gguf, tmp_path) -> None:
    out = write_shaped_gguf(tiny_gguf, tmp_path / "shaped.gguf", SHAPE, "Q4_K_M", context=2048)
    source, copy = GGUFReader(tiny_gguf), GGUFReader(out)
    meta = {name: copy.fields[name].contents() for name in copy.fields if name.startswith("llama.")}
    assert meta["llama.embedding_length"] == 512 and meta["llama.block_count"] == 2
    assert meta["llama.attention.head_count"] == 8 and meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.feed_forward_length"] == 1024 and meta["llama.context_length"] == 2048
    assert meta["llama.rope.dimension_count"] == 64
    tokenizer = [name for name in source.fields if name.startswith("tokenizer.")]
    assert tokenizer and all(copy.fields[n].contents() == source.fields[n].contents() for n in tokenizer)

    tensors = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in copy.tensors}
    vocab = int(next(t for t in source.tensors if t.name == "token_embd.weight").shape[1])
    # The head is untied: the embedding stays Q4_K, the head is Q6_K; layer 1 of 2 gets more bits.
    assert tensors["token_embd.weight"] == ("Q4_K", [512, vocab])
    assert tensors["output.weight"] == ("Q6_K", [512, vocab])
    assert tensors["output_norm.weight"] == ("F32", [512])
    assert tensors["blk.0.attn_q.weight"] == ("Q4_K", [512, 512])
    assert tensors["blk.0.attn_k.weight"] == ("Q4_K", [512, 128])
    assert tensors["blk.0.attn_v.weight"] == ("Q4_K", [512, 128])
    assert tensors["blk.1.attn_v.weight"] == ("Q6_K", [512, 128])
    assert tensors["blk.0.ffn_down.weight"] == ("Q4_K", [1024, 512])
    assert tensors["blk.1.ffn_down.weight"] == ("Q6_K", [1024, 512])
    assert tensors["blk.1.ffn_up.weight"] == ("Q4_K", [512, 1024])
    assert len(tensors) == 3 + 2 * 9
    for name in ("blk.0.ffn_up.weight", "output.weight"):
        tensor = next(t for t in copy.tensors if t.name == name)
        weights = dequantize(np.array(tensor.data), GGMLQuantizationType[tensor.tensor_type.name])
        assert np.isfinite(weights).all() and 0.015 < weights.std() < 0.025 and abs(weights.mean()) < 1e-3

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(out), max_model_len=2048, kv_cache_memory="64MiB", kv_disk=False)
    assert not [w for w in caught if "dequantised to float" in str(w.message)]
    reply = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    llm.close()
    assert reply.finish_reason == "length" and len(reply.token_ids) == 4


def test_rows_that_hold_no_k_blocks_fall_back_as_llama_cpp_does() -> None:
    assert mix_type("blk.0.attn_q.weight", 64, 2, "Q4_K_M", tied=True) == "Q5_0"
    assert mix_type("blk.1.attn_v.weight", 64, 2, "Q4_K_M", tied=True) == "Q8_0"  # Q6_K's fallback
    assert mix_type("token_embd.weight", 64, 2, "Q4_K_M", tied=True) == "Q8_0"
    assert mix_type("token_embd.weight", 256, 2, "Q4_K_M", tied=True) == "Q6_K"  # the tied head
    assert mix_type("token_embd.weight", 256, 2, "Q4_0", tied=True) == "Q6_K"
    assert mix_type("blk.1.ffn_down.weight", 256, 2, "Q4_0", tied=True) == "Q4_0"
    assert mix_type("token_embd.weight", 256, 2, "Q8_0", tied=True) == "Q8_0"
    assert mix_type("blk.0.attn_qkv.weight", 256, 2, "Q4_K_M", tied=True) == "Q4_K"  # a fused QKV: as attn_v
    assert mix_type("blk.1.attn_qkv.weight", 256, 2, "Q5_K_M", tied=True) == "Q6_K"
    assert mix_type("blk.1.ffn_down.weight", 256, 2, "Q5_K_M", tied=True) == "Q6_K"
    assert mix_type("blk.0.ffn_up.weight", 256, 2, "Q5_K_M", tied=True) == "Q5_K"
    assert mix_type("blk.0.ffn_up.weight", 64, 2, "Q5_K_M", tied=True) == "Q5_1"
    assert mix_type("blk.0.ffn_up.weight", 256, 2, "Q6_K", tied=True) == "Q6_K"


SOURCE_VOCAB = 49152  # the default model's tokenizer, which tiny_gguf carries
FAMILIES = {
    # biases on Q, K and V; the vocabulary padded past the tokenizer as llama.cpp's converter pads it
    "qwen2": Shape(256, 2, 4, 2, 512, arch="qwen2", vocab=50_000),
    # norms on Q and K; a head size other than the width over the heads (a Q of 128 columns: K blocks fall back)
    "qwen3": Shape(256, 2, 4, 2, 512, arch="qwen3", head_dim=32),
    # QKV and gate/up fused, an untied head, partial rotary, the vocabulary cut to its first 40,000 tokens
    "phi3": Shape(256, 2, 4, 4, 512, arch="phi3", vocab=40_000, rotary_dim=48, tied=False),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gets_its_layout_and_vocabulary_and_decodes(family, tiny_gguf, tmp_path) -> None:
    shape = FAMILIES[family]
    out = write_shaped_gguf(tiny_gguf, tmp_path / f"{family}.gguf", shape, "Q5_K_M", context=2048)
    copy = GGUFReader(out)
    fields = {name: copy.fields[name].contents() for name in copy.fields if not name.startswith("GGUF.")}
    vocab = shape.vocab or SOURCE_VOCAB
    assert fields["general.architecture"] == family and not [n for n in fields if n.startswith("llama.")]
    assert fields[f"{family}.vocab_size"] == vocab == len(fields["tokenizer.ggml.tokens"])
    assert len(fields["tokenizer.ggml.token_type"]) == vocab
    assert fields[f"{family}.rope.dimension_count"] == (shape.rotary_dim or shape.head)
    tensors = {t.name: (t.tensor_type.name, [int(d) for d in t.shape]) for t in copy.tensors}
    h, q, kv = shape.hidden, shape.heads * shape.head, shape.kv_heads * shape.head
    assert tensors["token_embd.weight"][1] == [h, vocab]
    assert ("output.weight" in tensors) == (not shape.tied)
    if family == "qwen2":
        assert tensors["blk.0.attn_q.bias"] == ("F32", [q]) and tensors["blk.1.attn_v.bias"] == ("F32", [kv])
        assert (
            fields["tokenizer.ggml.tokens"][-1] == f"[PAD{vocab - 1}]" and fields["tokenizer.ggml.token_type"][-1] == 5
        )
    if family == "qwen3":
        assert fields["qwen3.attention.key_length"] == fields["qwen3.attention.value_length"] == 32
        assert tensors["blk.0.attn_q_norm.weight"] == ("F32", [32]) and tensors["blk.0.attn_q.weight"][1] == [h, q]
        assert tensors["blk.0.attn_output.weight"] == ("Q5_1", [q, h])  # 128 columns hold no K block
    if family == "phi3":
        assert tensors["blk.0.attn_qkv.weight"] == ("Q5_K", [h, q + 2 * kv])
        assert tensors["blk.1.attn_qkv.weight"] == ("Q6_K", [h, q + 2 * kv])
        assert tensors["blk.0.ffn_up.weight"] == ("Q5_K", [h, 2 * shape.intermediate])
        assert "blk.0.ffn_gate.weight" not in tensors
        kept = set(fields["tokenizer.ggml.tokens"])
        assert all(
            a in kept and b in kept and a + b in kept
            for a, b in (m.split(" ") for m in fields["tokenizer.ggml.merges"])
        )
    for tensor in copy.tensors:
        if tensor.tensor_type.name in ("Q5_K", "Q5_1"):
            weights = dequantize(np.array(tensor.data), GGMLQuantizationType[tensor.tensor_type.name])
            assert np.isfinite(weights).all() and 0.015 < weights.std() < 0.025 and abs(weights.mean()) < 1e-3

    llm = LLM(str(out), max_model_len=2048, kv_cache_memory="64MiB", kv_disk=False)
    assert llm.runner.model.layers[0].self_attn.head_dim == shape.head
    reply = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    llm.close()
    assert reply.finish_reason == "length" and len(reply.token_ids) == 4 and max(reply.token_ids) < vocab
