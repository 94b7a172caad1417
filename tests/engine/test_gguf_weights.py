"""GGUF tensors kept as blocks: the values are exactly those transformers' float32 conversion holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from localpaged.models.gguf_weights import BlockQuantized, _unpack, read_gguf
from localpaged.models.loader import default_model_path


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_unpacked_blocks_dequantise_to_gguf_py_values_bit_for_bit(kind):
    data = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = quantize(data, GGMLQuantizationType[kind])
    ours = _unpack(raw, kind).dequantize()
    assert torch.equal(ours, torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)))


@pytest.mark.model
def test_default_model_blocks_equal_the_converted_float32_weights(default_model_folder):
    from safetensors import safe_open
    from transformers import AutoConfig

    with safe_open(default_model_folder / "model.safetensors", "pt") as converted:
        names = list(converted.keys())
        ours = read_gguf(default_model_path(), names, AutoConfig.from_pretrained(default_model_folder))
        assert sorted(ours) == sorted(names)
        assert (
            sum(isinstance(v, BlockQuantized) for v in ours.values()) == 211
        )  # 7 projections x 30 layers + embeddings
        for name in names:
            value = ours[name]
            value = value.dequantize() if isinstance(value, BlockQuantized) else value
            assert torch.equal(value, converted.get_tensor(name)), name


@pytest.mark.model
def test_default_model_on_the_cpu_runs_on_its_blocks(default_llm):
    from localpaged.kernels import cpu

    from localpaged.models.quantized import BlockEmbedding, BlockLinear

    if cpu.library() is None or default_llm.device.type != "cpu":
        pytest.skip("the native CPU kernels are not built here")
    model = default_llm.runner.model
    assert default_llm.config.weights == "auto"
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert all(
        isinstance(m, BlockLinear)
        for m in (model.lm_head, model.layers[0].self_attn.qkv_proj, model.layers[-1].mlp.down_proj)
    )
