"""Llama-family forward pass (Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3) over a flat, ragged batch of tokens.

All sequences of a step are one flat row of tokens, as in vLLM: no padding, positions given per
token, and each layer writes its new K/V into the paged cache and attends through the attention
path. q/k/v and gate/up projections are fused into one matmul each (Phi-3 checkpoints store them so).
Weight names follow Hugging Face, so a transformers checkpoint loads as it is. This file reads the
config and composes layers; each layer (``localpaged.layers``) picks its own kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from localpaged.errors import UnsupportedModelError
from localpaged.layers.activation import SiluAndMul
from localpaged.layers.attention import Attention, AttentionMetadata, AttentionPath
from localpaged.layers.layernorm import RMSNorm
from localpaged.layers.linear import Linear, PromptRows
from localpaged.layers.rotary_embedding import RotaryEmbedding

# Our fused projections and the Hugging Face projections they hold, in row order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, head_dim: int, attention: AttentionPath) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = Linear(
            self.num_heads * head_dim, config.hidden_size, bias=bool(getattr(config, "attention_bias", False))
        )
        # Qwen3 RMS-normalises each head of q and k before RoPE.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.model_type == "qwen3" else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.model_type == "qwen3" else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, attention)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x, meta.prompt_rows)
        if self.q_norm is not None:
            qkv = self.norm_heads(qkv)
        return self.o_proj(self.attn(qkv, cos, sin, meta), meta.prompt_rows)

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` with every head of q and k RMS-normalised (q_norm, k_norm), v as it is."""
        n, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(n * self.num_heads, d))[0].reshape(n, -1)
        k = self.k_norm(k.reshape(n * self.num_kv_heads, d))[0].reshape(n, -1)
        return torch.cat([q, k, v], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, prompt_rows: PromptRows | None = None) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x, prompt_rows)), prompt_rows)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, head_dim: int, attention: AttentionPath) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, head_dim, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the last sublayer's output, not yet added to ``residual`` (None before the first layer)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, meta), residual)
        return self.mlp(h, meta.prompt_rows), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, attention: AttentionPath, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        # Our fused projection -> the checkpoint's shards; Phi-3 stores qkv_proj and gate_up_proj fused already.
        self.fused = {} if config.model_type == "phi3" else FUSED
        # Given its (empty) weight, nn.Embedding skips its random init: on the meta device that init runs
        # torch's Python reference ops, whose import pulls in torch._dynamo and Triton (a large RSS on a CPU).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.head_dim, attention) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of a flat batch; ``compute_logits`` turns chosen rows into logits."""
        cos, sin = self.rotary_emb(positions)
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
