"""Llama-family forward pass (Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3) over a flat, ragged batch of tokens.

All sequences of a step are one flat row of tokens, as in vLLM: no padding, positions given per
token, and each layer writes its new K/V into the paged cache and attends through the attention
path. q/k/v and gate/up projections are fused into one matmul each (Phi-3 checkpoints store them so).
Weight names follow Hugging Face, so a transformers checkpoint loads as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from localpaged.attention import AttentionMetadata
from localpaged.errors import UnsupportedModelError
from localpaged.kernels import cpu

# Our fused projections and the Hugging Face projections they hold, in row order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_params(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rotary_dim_of(config, head_dim: int) -> int:
    """Dimensions of each head that RoPE rotates: all but where ``partial_rotary_factor`` says (Phi-4-mini: 0.75)."""
    factor = rope_params(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


def rope_frequencies(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotated dimensions, and the factor that scales cos and sin (1 but for LongRoPE).

    Only the first ``rotary_dim_of`` dimensions of each head rotate. Scaling: linear, llama3, Phi-3's LongRoPE, and a GGUF's ``rope_freqs`` tensor (llama.cpp's
    per-dimension divisors, what its converter writes for Llama 3.x; ``rope_freq_factors`` in the config).
    LongRoPE uses its long factors when the engine's context (``max_positions``) exceeds the original
    training context and its short ones otherwise, at every position alike, as llama.cpp chooses by its
    context size. transformers chooses per forward pass by the sequence's length; the two agree on any
    sequence kept within the original context or run with long factors from its first token. One table
    per position is what prefix caching needs: a block's K/V may depend on nothing but its tokens.
    """
    params = rope_params(config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    dim = rotary_dim_of(config, head_dim)
    if kind == "longrope":  # in float32 as transformers computes it
        original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
        factors = torch.tensor(params["long_factor" if max_positions > original else "short_factor"])
        factor = params.get("factor") or config.max_position_embeddings / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        return 1.0 / (factors.float() * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freq_factors = getattr(config, "rope_freq_factors", None)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / params["factor"]).float(), 1.0
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported; supported: default, linear, llama3, longrope")


class Linear(nn.Linear):
    """nn.Linear that, on the CPU and for the few rows of a decode step, computes ``(W @ x.T).T``.

    MKL's GEMM is about 1.8x faster in that orientation for 1-128 rows, and decode steps are such
    rows. A very tall weight (the LM head: 49152 rows) goes in slices of ``ROW_SLICE`` rows, which
    keeps each slice's working set in cache (measured here, 16 rows: 39 ms as F.linear, 26 ms
    transposed, 20 ms sliced).
    """

    ROW_SLICE = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.shape[0] > 128:
            return F.linear(x, self.weight, self.bias)
        xt = x.t()
        if self.weight.shape[0] > 8 * self.ROW_SLICE:
            out = torch.cat([torch.mm(w, xt) for w in self.weight.split(self.ROW_SLICE)]).t()
        else:
            out = torch.mm(self.weight, xt).t()
        return out + self.bias if self.bias is not None else out


def native(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the native CPU kernels (float32 on a CPU where they built)."""
    return cpu.runs(x.device, x.dtype)


class RMSNorm(nn.Module):
    """RMS norm of ``x + residual``, fused as in vLLM: returns the normed rows and the sum (the new residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if native(x) and x.shape[-1] % 8 == 0:
            return cpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:  # one fused kernel; same result as the general path below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, head_dim]`` by per-token ``cos``/``sin`` ``[N, 1, rotary_dim/2]`` (halves layout);
    dimensions past ``rotary_dim`` (partial rotary) pass through."""
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, head_dim: int, attention) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = Linear(
            self.num_heads * head_dim, config.hidden_size, bias=bool(getattr(config, "attention_bias", False))
        )
        self.attention = attention
        # Qwen3 RMS-normalises each head of q and k before RoPE.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.model_type == "qwen3" else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.model_type == "qwen3" else None
        self.k_cache: torch.Tensor | None = None  # bound by the runner to this layer's slice of the pool
        self.v_cache: torch.Tensor | None = None

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self.norm_heads(qkv)
        full_rotary = 2 * cos.shape[-1] == self.head_dim
        if native(qkv) and full_rotary and self.head_dim % 16 == 0 and self.k_cache.dtype in cpu.KV_DTYPES:  # one pass
            q = cpu.rope_write_kv(qkv, cos, sin, meta.slot_mapping, self.k_cache, self.v_cache, self.num_heads)
        else:
            q = self.rope_and_write_kv(qkv, cos, sin, meta)
        out = self.attention.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` with every head of q and k RMS-normalised (q_norm, k_norm), v as it is."""
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(n * self.num_heads, d))[0].reshape(n, -1)
        k = self.k_norm(k.reshape(n * self.num_kv_heads, d))[0].reshape(n, -1)
        return torch.cat([q, k, v], dim=-1)

    def rope_and_write_kv(self, qkv, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """Rotate q and k, store k and v in the cache; returns q ``[N, heads, head_dim]``."""
        n = qkv.shape[0]
        qk, v = qkv.split(
            [(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        qk = apply_rope(qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)  # q and k in one go
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        self.attention.write_kv(k, v.reshape(n, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache, meta)
        return q


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if native(gate_up) and gate_up.shape[-1] % 16 == 0:
            return self.down_proj(cpu.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, head_dim, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the last sublayer's output, not yet added to ``residual`` (None before the first layer)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, meta), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, attention, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        # Our fused projection -> the checkpoint's shards; Phi-3 stores qkv_proj and gate_up_proj fused already.
        self.fused = {} if config.model_type == "phi3" else FUSED
        # Given its (empty) weight, nn.Embedding skips its random init: on the meta device that init runs
        # torch's Python reference ops, whose import pulls in torch._dynamo and Triton (~100 MB RSS on a CPU).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.head_dim, attention) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        rotary_half = rotary_dim_of(config, self.head_dim) // 2
        self.register_buffer("rope_cos", torch.empty(max_positions, rotary_half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, rotary_half), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """Fill the float32 cos/sin tables; called again once a model built on the meta device has memory."""
        if self.rope_cos.is_meta:
            return
        inv_freq, scale = rope_frequencies(self.config, self.head_dim, self.rope_cos.shape[0])
        positions = torch.arange(self.rope_cos.shape[0], dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq).to(self.rope_cos.device)
        self.rope_cos, self.rope_sin = freqs.cos(), freqs.sin()
        if scale != 1.0:  # LongRoPE's attention factor, on cos and sin as transformers applies it
            self.rope_cos, self.rope_sin = self.rope_cos * scale, self.rope_sin * scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of a flat batch; ``compute_logits`` turns chosen rows into logits."""
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hf_weight_names(self) -> list[str]:
        """The Hugging Face names of the weights this model loads (fused projections listed shard by shard)."""
        names = []
        for name in dict(self.named_parameters()):
            parts = name.split(".")
            prefix = "" if parts[0] == "lm_head" else "model."
            shards = self.fused.get(parts[-2], (parts[-2],))
            names += [prefix + ".".join([*parts[:-2], shard, parts[-1]]) for shard in shards]
        return names

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face weights in, fusing q/k/v and gate/up; every parameter must be fully covered."""
        q = self.config.num_attention_heads * self.head_dim
        kv = self.config.num_key_value_heads * self.head_dim
        inter = self.config.intermediate_size
        shards = {  # HF projection -> (our fused projection, first row)
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q),
            "v_proj": ("qkv_proj", q + kv),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", inter),
        }
        own = dict(self.named_parameters())
        rows_loaded = dict.fromkeys(own, 0)
        for hf_name, tensor in state.items():
            parts = hf_name.removeprefix("model.").split(".")  # e.g. layers.3.self_attn.q_proj.weight
            offset = 0
            if len(parts) == 5 and parts[3] in shards:
                parts[3], offset = shards[parts[3]]
            name = ".".join(parts)
            if name not in own:
                continue  # buffers such as rotary inv_freq in older checkpoints
            own[name].data[offset : offset + tensor.shape[0]].copy_(tensor)
            rows_loaded[name] += tensor.shape[0]
        if "lm_head.weight" in own and (self.config.tie_word_embeddings or not rows_loaded["lm_head.weight"]):
            self.lm_head.weight = self.embed_tokens.weight
            rows_loaded["lm_head.weight"] = self.lm_head.weight.shape[0]
        missing = [n for n, p in own.items() if rows_loaded.get(n, 0) != p.shape[0]]
        if missing:
            raise UnsupportedModelError(
                f"the checkpoint does not cover every weight the model needs, e.g. {missing[:3]}"
            )
