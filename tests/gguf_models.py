"""Tiny random models written as GGUF files, with tensors of every quantisation type the engine reads.

gguf-py quantises Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 but has no quantiser for the K formats, so a small
numpy one is here: any valid encoding checks the unpacking, and this one stays close to the float
weights so the tiny model still has peaked logits. The tokenizer metadata is the default model's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quantize

QK_K = 256


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [n, 2], the same values widened back to fp32 [n, 1])."""
    half = values.astype(np.float16)
    return half.reshape(-1, 1).view(np.uint8), half.astype(np.float32).reshape(-1, 1)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _quantize_k_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K (levels 16) or Q5_K (32): per 256-weight block, 8 runs of 32 with 6-bit scales and mins."""
    runs = x.reshape(-1, 8, 32)
    low = np.minimum(runs.min(axis=2), 0)
    run_scale, run_min = (runs.max(axis=2) - low) / (levels - 1), -low
    d_bytes, d = _fp16(run_scale.max(axis=1) / 63)
    dmin_bytes, dmin = _fp16(run_min.max(axis=1) / 63)
    sc = np.clip(np.round(_safe_div(run_scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(run_min, dmin)), 0, 63).astype(np.uint8)
    scale, minimum = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.round(_safe_div(runs + minimum, scale + 0 * runs)), 0, levels - 1).astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    low4 = q & 15
    qs = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, 128)  # runs 2c and 2c+1 share 32 bytes
    return d_bytes, dmin_bytes, scales, q, qs


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, _, qs = _quantize_k_affine(x, 16)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q, qs = _quantize_k_affine(x, 32)
    high = (q >> 4).astype(np.uint8)  # [blocks, 8 runs, 32]: bit i of byte j is run i's weight j
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: per 256-weight block, 16 runs of 16 with signed 8-bit scales, q in -32..31."""
    runs = x.reshape(-1, 16, 16)
    run_scale = np.abs(runs).max(axis=2) / 31
    d_bytes, d = _fp16(run_scale.max(axis=1) / 127)
    sc = np.clip(np.round(_safe_div(run_scale, d)), -128, 127).astype(np.int8)
    scale = (d * sc)[..., None]
    q = np.clip(np.round(_safe_div(runs, scale + 0 * runs)), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 128).astype(np.uint8)  # two halves of 128 weights
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce(
        high.reshape(-1, 2, 4, 32) << (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None], axis=2
    )
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)


def quantize_any(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``[rows, cols]`` -> GGUF bytes ``[rows, bytes_per_row]`` of ``kind``.

    Q2_K has no quantiser here: random bytes with small fp16 scales are a valid encoding of it.
    """
    rows = x.shape[0]
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        encode = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}[kind]
        return encode(x.reshape(-1, QK_K).astype(np.float32)).reshape(rows, -1)
    if kind == "Q2_K":
        blocks = np.random.default_rng(rows).integers(0, 256, (x.size // QK_K, 84), dtype=np.uint8)
        blocks[:, 80:84] = np.full((len(blocks), 2), 0.002, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    if kind in ("F32", "F16"):
        return x.astype(np.float32 if kind == "F32" else np.float16)
    return quantize(x.astype(np.float32), GGMLQuantizationType[kind])


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order for a Q or K projection (what convert_hf_to_gguf.py writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tokenizer_fields(default_gguf: Path) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """The default model's ``tokenizer.*`` metadata, ready for ``GGUFWriter.add_key_value``."""
    fields = []
    for name, field in GGUFReader(default_gguf).fields.items():
        if name.startswith("tokenizer."):
            main = field.types[0]
            fields.append((name, field.contents(), main, field.types[-1] if main == GGUFValueType.ARRAY else None))
    return fields


def rope_tensors(config, writer: GGUFWriter) -> dict[str, np.ndarray]:
    """What llama.cpp's convert_hf_to_gguf.py writes for a scaled RoPE: LongRoPE's factor tensors, original
    context and attention factor (Phi-3.5), or llama3 scaling baked into per-dimension divisors (Llama 3.x)."""
    params = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if params.get("rope_type") == "longrope":
        original = params["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        return {
            "rope_factors_long.weight": np.array(params["long_factor"], np.float32),
            "rope_factors_short.weight": np.array(params["short_factor"], np.float32),
        }
    if params.get("rope_type") == "llama3":
        freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        factors = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": np.array(factors, np.float32)}
    return {}


def write_gguf(path: Path, hf_model, arch: str, types: dict[str, str], tokenizer: list | None) -> Path:
    """``hf_model`` (a transformers Llama, Qwen2/3 or Phi-3) as a GGUF file; ``types`` maps GGUF tensor names to a
    type (everything unnamed: Q8_0 for 2-D weights, F32 for norms, biases and RoPE factors). ``tokenizer=None``
    writes none."""
    config = hf_model.config
    writer = GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
    for name, value, vtype, sub_type in tokenizer or []:
        writer.add_key_value(name, value, vtype, sub_type)
    for name, factors in rope_tensors(config, writer).items():
        writer.add_tensor(name, factors)
    for hf_name, tensor in hf_model.state_dict().items():
        parts = hf_name.removeprefix("model.").split(".")
        if parts[0] == "embed_tokens":
            name = "token_embd." + parts[-1]
        elif parts[0] == "norm":
            name = "output_norm." + parts[-1]
        elif parts[0] == "lm_head":
            if config.tie_word_embeddings:
                continue
            name = "output." + parts[-1]
        else:
            name = f"blk.{parts[1]}.{GGUF_NAMES['.'.join(parts[2:-1])]}.{parts[-1]}"
        data = tensor.detach().float().numpy()
        if arch == "llama" and parts[-2:] in (["q_proj", "weight"], ["k_proj", "weight"]):
            heads = config.num_attention_heads if parts[-2] == "q_proj" else config.num_key_value_heads
            data = _llama_permute(data, heads)
        kind = types.get(name, "Q8_0" if data.ndim == 2 else "F32")
        encoded = quantize_any(data, kind)
        raw_dtype = None if kind in ("F32", "F16") else GGMLQuantizationType[kind]
        writer.add_tensor(name, encoded, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Every native type at least once over two layers, the K formats on projections and on the
# embeddings, a tied-or-not head, and one Q2_K projection (no native kernel: dequantised at load).
MIXED_TYPES = {
    "token_embd.weight": "Q6_K",
    "output.weight": "Q5_K",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q5_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q5_0",
    "blk.0.ffn_gate.weight": "Q5_1",
    "blk.0.ffn_up.weight": "Q4_0",
    "blk.0.ffn_down.weight": "Q4_1",
    "blk.1.attn_q.weight": "Q8_0",
    "blk.1.attn_k.weight": "Q4_K",
    "blk.1.attn_v.weight": "Q5_0",
    "blk.1.attn_output.weight": "Q2_K",
    "blk.1.ffn_gate.weight": "Q6_K",
    "blk.1.ffn_up.weight": "Q4_K",
    "blk.1.ffn_down.weight": "F16",
}


# MIXED_TYPES with its two projections that have no native kernel swapped for native types: a model whose every
# projection runs on the CPU kernels (and whose decode steps NativeDecode takes).
NATIVE_TYPES = {**MIXED_TYPES, "blk.1.attn_output.weight": "Q8_0", "blk.1.ffn_down.weight": "Q5_K"}


def tiny_hf_model(arch: str, tie: bool = False, rope: dict | None = None, max_positions: int = 2048):
    """A random transformers model whose rows are multiples of 256 (K-quant blocks) and whose logits are peaked;
    ``rope`` adds RoPE parameters (scaling, partial rotary) to its config."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    common = {
        "vocab_size": 49152,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        "initializer_range": 0.3,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0 if arch in ("llama", "phi3") else 1000000.0}
    rope_parameters.update(rope or {})
    common["rope_parameters"] = rope_parameters
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if arch == "phi3":  # the original context: LongRoPE's short factors below it, long ones past it
        original = rope_parameters.get("original_max_position_embeddings", max_positions)
        return Phi3ForCausalLM(Phi3Config(original_max_position_embeddings=original, **common)).eval()
    if arch == "qwen3":  # head_dim 128, not hidden / heads: as Qwen3's own (and transformers' default for a GGUF)
        return Qwen3ForCausalLM(Qwen3Config(head_dim=128, **common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
