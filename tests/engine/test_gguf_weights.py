"""GGUF files run as they are: blocks unpacked to exactly gguf-py's values, tiny GGUF models on parity with
transformers reading the same file, no float32 copy in the cache, and one clear error per broken file."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from localpaged.errors import InvalidModelError, KernelArgumentError, UnsupportedModelError
from localpaged.kernels import cpu
from localpaged.models import gguf_weights
from localpaged.models.gguf_file import GGUFFile
from localpaged.models.gguf_weights import NATIVE_TYPES, BlockQuantized, GGUFWeights, unpack, unpack_numpy
from tests.gguf_models import MIXED_TYPES, quantize_any, tiny_hf_model, write_gguf
from tests.oracle import assert_same_greedy, exact_llm, hf_greedy, load_hf


@pytest.mark.parametrize("route", ["native", "numpy"])
@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_unpacked_blocks_dequantise_to_gguf_py_values_bit_for_bit(kind, route):
    data = np.random.default_rng(0).standard_normal((24, 512)).astype(np.float32)
    data[3] = 0.0  # an all-zero row: zero scales
    raw = quantize_any(data, kind)
    if route == "native" and cpu.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    blocks = unpack(raw, kind) if route == "native" else unpack_numpy(raw, kind)
    assert blocks.group == (16 if kind == "Q6_K" else 32)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    assert torch.equal(blocks.dequantize(), want)
    assert (blocks.dequantize() - torch.from_numpy(data)).abs().max() < 0.5  # the test quantiser is a real one


@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_native_unpacking_gives_numpys_bits_for_any_bytes(kind, monkeypatch):
    """Random bytes are valid blocks of other weights (fp16 fields may be NaN or infinite): both routes read every bit
    alike, numpy here in chunks of a few rows, as it reads a large tensor."""
    if cpu.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    raw = np.random.default_rng(2).integers(0, 256, size=(37, 4 * size), dtype=np.uint8)
    monkeypatch.setattr(gguf_weights, "CHUNK_WEIGHTS", 4 * size * 2 * 5)  # 5 rows a pass
    native = BlockQuantized(*cpu.unpack_gguf(raw, kind))
    monkeypatch.setattr(cpu, "library", lambda: None)
    chunked = unpack(raw, kind)
    for field in gguf_weights.BLOCK_FIELDS:
        want, got = getattr(chunked, field), getattr(native, field)
        assert got.dtype == want.dtype and got.shape == want.shape, field
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), field


def test_native_unpacking_refuses_what_it_cannot_read():
    if cpu.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    with pytest.raises(KernelArgumentError, match="lp_unpack_gguf reads"):
        cpu.unpack_gguf(np.zeros((1, 18), np.uint8), "IQ4_NL")
    with pytest.raises(KernelArgumentError, match="whole Q4_K blocks"):
        cpu.unpack_gguf(np.zeros((1, 100), np.uint8), "Q4_K")
    with pytest.raises(KernelArgumentError, match="C-ordered uint8"):
        cpu.unpack_gguf(np.zeros((4, 144), np.uint8)[:, ::2], "Q4_K")


def test_projections_of_different_group_sizes_fuse_without_changing_a_value():
    rng = np.random.default_rng(1)
    q, v = (unpack(quantize_any(rng.standard_normal((16, 256)).astype(np.float32), k), k) for k in ("Q4_K", "Q6_K"))
    fused = BlockQuantized.cat([q, v])
    assert fused.group == 16
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), v.dequantize()]))


@pytest.fixture(scope="module")
def mixed_llama(tmp_path_factory, gguf_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-mixed-llama.gguf"
    return write_gguf(path, tiny_hf_model("llama"), "llama", MIXED_TYPES, gguf_tokenizer)


@pytest.fixture(scope="module")
def mixed_llama_hf(mixed_llama):
    return load_hf(mixed_llama)


def _check_parity(llm, hf, label: str) -> None:
    tok = llm.tokenizer
    chat = list(
        tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)["input_ids"]
    )
    prompts = [[1], chat, list(range(100, 150))]
    from localpaged import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        want, gaps = hf_greedy(hf, prompt, 16)
        assert_same_greedy(out.token_ids, want, gaps, f"{label} prompt {i}")


def test_tiny_mixed_quant_llama_runs_its_blocks_and_matches_transformers_on_the_same_file(mixed_llama, mixed_llama_hf):
    from localpaged.kernels import cpu
    from localpaged.layers.linear import BlockLinear
    from localpaged.models.quantized import BlockEmbedding

    with pytest.warns(UserWarning, match=r"Q2_K tensors have no native kernel"):
        llm = exact_llm(mixed_llama)
    model = llm.runner.model
    if cpu.library() is not None:
        assert isinstance(model.embed_tokens, BlockEmbedding) and isinstance(model.lm_head, BlockLinear)
        assert not list(model.embed_tokens.buffers())  # lookups unpack rows of the mapped file: no copy kept
        assert model.layers[0].self_attn.qkv_proj.packed.group == 16  # Q4_K, Q5_K and Q6_K rows in one weight
        assert not isinstance(model.layers[1].self_attn.o_proj, BlockLinear)  # Q2_K: floats
        assert not isinstance(model.layers[1].mlp.down_proj, BlockLinear)  # F16: floats
    _check_parity(llm, mixed_llama_hf, "mixed llama")
    cached = [p for p in Path(llm.model_folder).rglob("*") if p.is_file()]
    assert not [p for p in cached if p.suffix == ".safetensors"]
    assert sum(p.stat().st_size for p in cached) < 8 << 20  # config and tokenizer only: no float32 copy


def test_float_weights_of_a_gguf_match_transformers_too(mixed_llama, mixed_llama_hf):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = exact_llm(mixed_llama, weights="float")
    assert llm.resolved.weights == "float"
    _check_parity(llm, mixed_llama_hf, "mixed llama, float weights")


def test_tiny_tied_qwen2_gguf_matches_transformers(tmp_path, gguf_tokenizer):
    types = {"token_embd.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_q.weight": "Q5_K"}
    path = write_gguf(tmp_path / "tiny-qwen2.gguf", tiny_hf_model("qwen2", tie=True), "qwen2", types, gguf_tokenizer)
    llm = exact_llm(path)
    assert llm.runner.model.config.tie_word_embeddings
    _check_parity(llm, load_hf(path), "tied qwen2")


def test_tiny_qwen3_gguf_with_q_and_k_norms_matches_transformers(tmp_path, gguf_tokenizer):
    types = {"blk.0.attn_q.weight": "Q4_K", "blk.1.attn_k.weight": "Q6_K"}
    path = write_gguf(tmp_path / "tiny-qwen3.gguf", tiny_hf_model("qwen3"), "qwen3", types, gguf_tokenizer)
    llm = exact_llm(path)
    assert llm.runner.model.layers[0].self_attn.q_norm is not None
    _check_parity(llm, load_hf(path), "qwen3")


@pytest.mark.model
def test_default_model_blocks_equal_transformers_weights_from_the_same_file(
    default_llm, default_model_source, default_hf
):
    """Every weight name maps, Q and K rows are un-permuted as transformers does it, the values are its values."""
    if default_model_source.is_dir():
        pytest.skip("a stand-in folder has no GGUF")
    hf_state = default_hf.state_dict()
    weights = GGUFWeights(GGUFFile(default_model_source), list(hf_state), default_llm.runner.model.config)
    ours = {name: weights.read(name) for name in weights.names}
    assert sorted(ours) == sorted(n for n in hf_state if n != "lm_head.weight")  # the head is tied: no copy in the file
    assert sum(isinstance(v, BlockQuantized) for v in ours.values()) == 211  # 7 projections x 30 layers + embeddings
    for name, value in ours.items():
        value = value.dequantize() if isinstance(value, BlockQuantized) else value
        assert torch.equal(value, hf_state[name]), name


@pytest.mark.model
def test_default_model_on_the_cpu_runs_on_its_blocks(default_llm):
    from localpaged.kernels import cpu
    from localpaged.layers.linear import BlockLinear
    from localpaged.models.quantized import BlockEmbedding

    if cpu.library() is None or default_llm.device.type != "cpu":
        pytest.skip("the native CPU kernels are not built here")
    model = default_llm.runner.model
    assert default_llm.resolved.weights == "auto"
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert all(
        isinstance(m, BlockLinear)
        for m in (model.lm_head, model.layers[0].self_attn.qkv_proj, model.layers[-1].mlp.down_proj)
    )


# ----- files that cannot run: one error naming the file, what it holds and what is supported -----


def test_an_unknown_architecture_is_named(tmp_path, gguf_tokenizer):
    from localpaged.models.loader import resolve_model

    path = write_gguf(tmp_path / "gemma.gguf", tiny_hf_model("llama"), "gemma2", {}, gguf_tokenizer)
    with pytest.raises(
        UnsupportedModelError, match=r"architecture 'gemma2' is not supported; supported: llama"
    ) as info:
        resolve_model(path)
    assert str(path) in str(info.value)


def test_a_gguf_without_a_tokenizer_is_named(tmp_path):
    from localpaged.models.loader import resolve_model

    path = write_gguf(tmp_path / "bare.gguf", tiny_hf_model("llama"), "llama", {}, None)
    with pytest.raises(InvalidModelError, match="no tokenizer in its metadata") as info:
        resolve_model(path)
    assert str(path) in str(info.value)


def test_a_truncated_tensor_is_named(mixed_llama, tmp_path):
    from localpaged.models.loader import resolve_model

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mixed_llama.read_bytes()[:-1000])
    with pytest.raises(InvalidModelError, match=r"tensor \S+ runs past the end of the file .* truncated") as info:
        resolve_model(cut)
    assert str(cut) in str(info.value)


@pytest.mark.parametrize("kind", NATIVE_TYPES)
def test_native_dequantizing_gives_the_unpacked_weights_bits(kind):
    """lp_dequantize_gguf (a step's embedding rows) is BlockQuantized.dequantize to the bit, for any bytes: subnormal
    and infinite fp16 factors, negative zeros, every multiplier; a NaN where it has a NaN (torch writes its own)."""
    if cpu.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    raw = np.random.default_rng(3).integers(0, 256, size=(37, 4 * size), dtype=np.uint8)
    want = BlockQuantized(*cpu.unpack_gguf(raw, kind)).dequantize()
    got = cpu.dequantize_gguf(raw, kind)
    assert got.shape == want.shape
    number = ~want.isnan()
    assert torch.equal(got.isnan(), ~number)
    assert torch.equal(got[number].view(torch.int32), want[number].view(torch.int32))
    with pytest.raises(KernelArgumentError, match="lp_dequantize_gguf reads"):
        cpu.dequantize_gguf(raw, "IQ4_NL")
