"""Everything the engine decides at start: device, dtype, context length, pool size, stop tokens.

Each decision fails early with the numbers and what to change, rather than at the first request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from localpaged.config import DRAFT_K_DEFAULT, EngineConfig, ResolvedConfig, check_field, parse_bytes
from localpaged.engine.engine_tokenizer import EngineTokenizer, load_engine_tokenizer
from localpaged.engine.kv_disk import BlockLayout, KVDiskTier, layout_fingerprint
from localpaged.engine.runner import ModelRunner
from localpaged.engine.speculative import AUTO_MAX_ROWS
from localpaged.errors import ConfigError
from localpaged.kernels import cpu
from localpaged.layers.attention import AttentionPath, select_attention
from localpaged.layers.rotary_embedding import rope_frequencies
from localpaged.locations import kv_cache_dir
from localpaged.models import Progress, huge_pages
from localpaged.models.gguf_file import GGUFFile
from localpaged.models.gguf_weights import BlockQuantized, GGUFWeights
from localpaged.models.llama import LlamaForCausalLM, head_dim_of
from localpaged.models.loader import ModelFiles, load_config, load_state_dict, resolve_model
from localpaged.models.packed_cache import PackedCache
from localpaged.models.quantized import swap_in_blocks
from localpaged.models.weights_digest import weights_digest

log = logging.getLogger(__name__)

MAX_DEFAULT_CONTEXT = 8192
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")
GiB = 1 << 30
HUGE_PAGES_SPARE = GiB  # memory left to the rest of the machine while the packed weights exist twice


@dataclass
class DraftParts:
    """The draft model of speculative decoding (engine.draft), loaded beside the target."""

    name: str
    model: LlamaForCausalLM
    attention: AttentionPath
    block_bytes: int  # its K/V of one block, which the pool counts in each block


@dataclass
class EngineParts:
    name: str
    folder: Path
    model: LlamaForCausalLM
    tokenizer: EngineTokenizer
    attention: AttentionPath
    device: torch.device
    kv_dtype: torch.dtype
    num_blocks: int
    block_bytes: int
    stop_token_ids: set[int]
    kv_disk: KVDiskTier | None
    resolved: ResolvedConfig
    draft: DraftParts | None = None  # with speculative={"draft": ...}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA GPU is visible to torch; use device='cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # The CPU default is fp32: float32 keeps a GGUF's blocks on the native kernels, which beat bfloat16
        # (weights dequantised, torch's matmuls) even on a CPU with AVX512-BF16. The KV cache's type is separate.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's element type: the one named, or for "auto" float16 where native CPU kernels with a
    fast float16 conversion (``KernelPath.fast_float16_kv``) run the model in float32, else the model's ``dtype``.

    float16 KV (float32 math): faster than float32 KV at long contexts and as fast on short chats
    (``benchmarks/cpu_kernel_bench.py --engine --kv-cache-dtype``), with half the pool's memory and the
    disk tier's bytes. Over the parity prompts it gives the very tokens of float32 KV, which stays the
    exact path (``kv_cache_dtype="float32"``) that the parity tests run (tests/engine/test_kv_cache_dtype.py).
    llama.cpp's default KV type is float16 as well. bfloat16 parts from it far more often (8 significant bits).
    """
    if name != "auto":
        return getattr(torch, name)
    fast_float16 = cpu.runs(device, dtype) and cpu.chosen_path().fast_float16_kv
    return torch.float16 if dtype == torch.float32 and fast_float16 else dtype


def use_block_weights(config: EngineConfig, files, device: torch.device, dtype: torch.dtype) -> bool:
    """Keep a GGUF's quantised blocks: on the CPU in float32, where the native kernels build.

    Faster than the same values dequantised to float32, in a fraction of their memory
    (``benchmarks/throughput.py`` runs both and prints model memory).
    """
    return config.weights == "auto" and files.gguf is not None and cpu.runs(device, dtype)


def resolve_activations(activations: str, blocks: bool) -> str:
    """What ``activations`` becomes for this model: "auto" is int16 on a GGUF's blocks where the CPU has AVX-512 VNNI,
    else float32 (the exact path, and all a float model has); int16 and int8 are refused where they cannot pay.

    int16 is the default where it runs: its matmuls beat float32 inputs (``benchmarks/cpu_kernel_bench.py`` times
    each activations type on the default model's shapes), and over the parity prompts every greedy token agrees with
    the exact path's, with float16 KV or float32 (tests/engine/test_kv_cache_dtype.py). Rounding a run of 32 to 16
    bits moves each value by under 2^-16 of the run's largest, less than a float16 KV cache's rounding.

    int8 inputs (kernels/cpu_qgemm_int8.c) are opt-in: faster still (the same benchmark), but over the parity prompts
    most greedy tokens part from the exact path, and the logits move by a sizeable part of their spread (far less
    with the MLPs' down projections left in float32: their inputs' outliers leave the rest of each run of 32 a few
    levels of 8 bits; tests/engine/test_integer_activations.py bounds it). llama.cpp rounds the same way. Without
    VNNI the plain C kernels would run, slower than the float32 one.

    The chunked prefill's attention follows (``layers.attention.select_attention``): with int16 or int8 inputs its
    scores run on int16 q and K and its weighted sum on bfloat16 weights and V, where the CPU has AVX-512 VNNI and
    BF16 (kernels/cpu_prefill_int16.c): it nearly halves a long prompt's attention (``benchmarks/cpu_kernel_bench.py``
    times a prefill chunk with float32 and int16 products). With float16 KV the parity prompts' greedy tokens stay the
    exact path's; over longer chats a rare near-tie parts, as with float16 KV alone (none with float32 prefill
    products, or with float32 KV).
    """
    if activations == "auto":
        return "int16" if blocks and cpu.vnni_is_fast() else "float32"
    if activations == "float32":
        return activations
    if not blocks:
        raise ConfigError(
            f"activations={activations!r} applies to a GGUF's blocks on the native CPU kernels (weights='auto', dtype "
            "float32, a CPU with a C compiler); this model runs float weights: use activations='float32'"
        )
    if not cpu.vnni_is_fast():
        raise ConfigError(
            f"activations={activations!r} needs a CPU with AVX-512 VNNI (this one lacks it, and the plain C kernel is "
            "slower than the float32 one): use activations='float32'"
        )
    return activations


def dequantized(tensor: torch.Tensor | BlockQuantized) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, BlockQuantized) else tensor


def stop_token_ids(tokenizer, hf_config) -> set[int]:
    """EOS and the chat template's end-of-turn tokens that this vocabulary actually has."""
    ids = set()
    for eos in (hf_config.eos_token_id, tokenizer.eos_token_id):
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids


def available_memory() -> int:
    """What the system can hand out without swapping: Linux's MemAvailable, which counts the page cache it can drop
    (a GGUF just read fills it), else the free pages alone."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def move_to_huge_pages(models: list[torch.nn.Module], device: torch.device) -> bool:
    """Whether the packed weights of ``models`` are copied onto 2 MiB pages once the engine runs
    (models/huge_pages.py): on the CPU, where Linux gives transparent huge pages and memory holds the copy with
    HUGE_PAGES_SPARE to spare while both exist."""
    if device.type != "cpu" or not huge_pages.huge_pages_available():
        return False
    size = huge_pages.packed_bytes([m.packed for model in models for m in huge_pages.projections(model)])
    if not size:
        return False
    if available_memory() < size + HUGE_PAGES_SPARE:
        log.info("packed weights stay on 4 KiB pages: too little free memory for a copy on huge pages")
        return False
    return True


def default_kv_memory(device: torch.device, one_sequence: int) -> int:
    """85% of what the GPU has free. On the CPU a quarter of available memory, at most 2 GiB, but at least
    ``one_sequence`` (the bytes of one sequence of max_model_len) where half of available memory holds it: a model
    with a wide KV (Phi-3.5-mini's 8,192 tokens take 3 GiB) then starts with its whole context."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    available = available_memory()
    return max(min(available // 4, 2 * GiB), min(one_sequence, available // 2))


def open_kv_disk(
    resolved: ResolvedConfig,
    disk_bytes: int,
    files: ModelFiles,
    hf_config,
    head_dim: int,
    attention,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> KVDiskTier | None:
    """The disk tier for this model and KV layout, in a folder named for everything that makes KV values differ.

    Kernels are part of it wherever they may round differently (native CPU kernels or torch, their
    instruction-set path, the attention backend, GGUF blocks or dequantised weights, the torch version,
    the GPU): when unsure, a separate folder costs one cold prefill, a shared one would cost wrong answers.
    """
    shape = (2, hf_config.num_hidden_layers, resolved.block_size, hf_config.num_key_value_heads, head_dim)
    inv_freq, rope_scale = rope_frequencies(hf_config, head_dim, resolved.max_model_len)
    rope = inv_freq.numpy().tobytes() + (repr(rope_scale).encode() if rope_scale != 1.0 else b"")
    native = cpu.runs(device, dtype)
    fields = {
        "format": "localpaged-kv-1",
        "weights_sha256": weights_digest(files.folder, files.gguf),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "block_shape": list(shape),
        "rope_inv_freq_sha256": hashlib.sha256(rope).hexdigest(),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "attention": attention.name,
        "weights": resolved.weights,
        "activations": resolved.activations,
        "native_cpu_kernels": native,
        # The instruction-set path (avx512, avx2, portable) and a kernel edit may change how sums round:
        # another path or another source is another tier.
        "cpu_kernels_path": cpu.chosen_path().name if native else None,
        "cpu_kernels_sha256": cpu.sources_sha256(cpu.chosen_path()) if native else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    nbytes = ModelRunner.bytes_per_block(hf_config, head_dim, resolved.block_size, kv_dtype)
    layout = BlockLayout(layout_fingerprint(fields), shape, fields["kv_dtype"], nbytes)
    try:
        return KVDiskTier(kv_cache_dir(), layout, disk_bytes)
    except (ConfigError, OSError) as exc:  # a cache: a folder it cannot have costs warm starts, never the start
        log.warning(
            "the disk KV tier is off for this run: %s. Chats start cold after a restart; pass --no-kv-disk "
            "(or kv_disk = false in the settings file) to say so and silence this",
            exc,
        )
        return None


def resolve_attention_name(name: str | None) -> str | None:
    """The attention path asked for: the setting, else $LOCALPAGED_ATTENTION (read here only), else None."""
    if name is not None:
        return name
    from_env = os.environ.get("LOCALPAGED_ATTENTION") or None
    try:
        check_field("attention", from_env)
    except ConfigError as exc:
        raise ConfigError(f"LOCALPAGED_ATTENTION: {exc}") from None
    return from_env


def load_model(
    files: ModelFiles,
    hf_config,
    blocks: bool,
    activations: str,
    attention_name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> tuple[LlamaForCausalLM, AttentionPath]:
    """The model of ``files`` with its weights on ``device``, and its attention path; ``blocks``: keep a GGUF's
    quantised blocks (``use_block_weights``)."""
    attention = select_attention(attention_name, device, dtype, head_dim_of(hf_config), activations)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, attention, max_model_len)
    # Each tensor made as it is declared, in ``dtype``, uninitialised: what to_empty(device).to(dtype) makes, without
    # the symbolic-shape machinery (and sympy) its empty_like loads into the process on first use.
    model = model._apply(
        lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
    )
    model.rotary_emb.init_tables()
    if files.gguf is None:
        model.load_hf_state_dict(load_state_dict(files.folder))
    else:
        weights = GGUFWeights(GGUFFile(files.gguf), model.hf_weight_names(), hf_config)
        if blocks:
            cache = PackedCache(files.fingerprint, activations)
            model.load_hf_state_dict(swap_in_blocks(model, weights, activations, cache))
        else:  # float weights, or the GPU: dequantised from the file into the model's dtype on its device
            model.load_hf_state_dict({n: dequantized(weights.read(n)) for n in weights.names})
    model.eval()
    return model, attention


def load_draft(
    config: EngineConfig,
    tokenizer,
    hf_config,
    attention_name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_model_len: int,
    progress: Progress,
) -> DraftParts:
    """The draft model ``config.speculative`` names, loaded as the target is (same device, dtype, KV type and
    kernels); a ConfigError where its vocabulary is not the target's or its context is shorter."""
    spec = config.speculative
    assert isinstance(spec, Mapping)
    files = resolve_model(spec["draft"], progress)
    progress("Loading the draft model", None)
    draft_config = load_config(files.folder)
    if load_engine_tokenizer(files.folder).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"speculative draft {files.name}: its vocabulary is not the target model's (the same tokens under the "
            "same ids): a draft must share the target's tokenizer; name a smaller model of the same family"
        )
    limit = min(draft_config.max_position_embeddings, getattr(draft_config, "sliding_window", None) or 1 << 30)
    if limit < max_model_len:
        raise ConfigError(
            f"speculative draft {files.name} reads {limit} positions, fewer than max_model_len={max_model_len}: "
            f"lower max_model_len to {limit} or name another draft"
        )
    blocks = use_block_weights(config, files, device, dtype)
    activations = resolve_activations(config.activations, blocks)
    model, attention = load_model(
        files, draft_config, blocks, activations, attention_name, device, dtype, max_model_len
    )
    block_bytes = ModelRunner.bytes_per_block(draft_config, model.head_dim, config.block_size, kv_dtype)
    return DraftParts(files.name, model, attention, block_bytes)


def build_engine_parts(
    config: EngineConfig, progress: Progress | None = None, files: ModelFiles | None = None
) -> EngineParts:
    """Everything the engine needs; ``files`` is the model already resolved (else resolved from config.model).

    ``config`` is only read: what its "auto" and None became is the parts' ``resolved`` record.
    """
    progress = progress or (lambda message, fraction: None)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, device)
    if config.num_threads and device.type == "cpu":
        torch.set_num_threads(config.num_threads)
    files = files or resolve_model(config.model, progress)
    progress("Loading the model", None)
    hf_config = load_config(files.folder)
    # The tokenizer loads in a thread while the weights do: a first load (transformers' import and parsing) is mostly
    # Python, a first packing of the weights native code that lets the thread run. Nothing reads it before the
    # draft model's check.
    loading = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    tokenizer_job = loading.submit(load_engine_tokenizer, files.folder)
    loading.shutdown(wait=False)  # the job runs to its end; the pool takes no other

    model_limit = min(hf_config.max_position_embeddings, getattr(hf_config, "sliding_window", None) or 1 << 30)
    max_model_len = config.max_model_len or min(model_limit, MAX_DEFAULT_CONTEXT)
    if max_model_len > model_limit:
        raise ConfigError(f"max_model_len={max_model_len} exceeds what {files.name} supports ({model_limit})")
    max_num_batched_tokens = config.max_num_batched_tokens or (8192 if device.type == "cuda" else 512)

    target_bytes = ModelRunner.bytes_per_block(hf_config, head_dim_of(hf_config), config.block_size, kv_dtype)
    kv_bytes = parse_bytes(config.kv_cache_memory) if config.kv_cache_memory is not None else None
    if kv_bytes is None and not isinstance(config.speculative, Mapping):
        kv_bytes = default_kv_memory(device, -(-max_model_len // config.block_size) * target_bytes)
        if config.max_model_len is None:  # neither was asked for: the default context shortens to what the pool holds
            max_model_len = min(max_model_len, max(kv_bytes // target_bytes, 1) * config.block_size)

    blocks = use_block_weights(config, files, device, dtype)
    activations = resolve_activations(config.activations, blocks)
    attention_name = resolve_attention_name(config.attention)
    model, attention = load_model(files, hf_config, blocks, activations, attention_name, device, dtype, max_model_len)
    tokenizer = tokenizer_job.result()
    draft = None
    if isinstance(config.speculative, Mapping):
        draft = load_draft(
            config, tokenizer, hf_config, attention_name, device, dtype, kv_dtype, max_model_len, progress
        )

    block_bytes = target_bytes + (draft.block_bytes if draft is not None else 0)  # the draft's K/V of each block too
    needed = -(-max_model_len // config.block_size)
    if kv_bytes is None:  # a draft model's K/V shares the pool
        kv_bytes = default_kv_memory(device, needed * block_bytes)
    num_blocks = kv_bytes // block_bytes
    if num_blocks < needed:
        raise ConfigError(
            f"the KV pool ({kv_bytes / 2**20:.0f} MiB = {num_blocks} blocks of {block_bytes / 2**10:.0f} KiB"
            f"{' with the draft model' + chr(39) + 's K/V' if draft is not None else ''}) cannot hold one "
            f"sequence of max_model_len={max_model_len} ({needed} blocks); raise kv_cache_memory to at least "
            f"{needed * block_bytes / 2**20:.0f} MiB or lower max_model_len"
        )
    native = cpu.runs(device, dtype)
    resolved = ResolvedConfig(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        weights="auto" if blocks else "float",
        activations=activations,
        attention=attention.name,
        cpu_kernels=cpu.chosen_path().name if native else None,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        kv_cache_bytes=num_blocks * block_bytes,
        num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_disk=config.kv_disk and config.enable_prefix_caching,
        cascade_attention=config.cascade_attention,
        huge_pages=move_to_huge_pages([model] + ([draft.model] if draft is not None else []), device),
        speculative="draft" if draft is not None else "suffix" if config.speculative == "auto" else config.speculative,
        # "auto" and a draft model keep a step within the rows drafts pay for: a draft model also runs its own
        # passes for every chat that drafts, which many chats at once do not win back
        speculative_max_rows=AUTO_MAX_ROWS["cpu" if device.type == "cpu" else "gpu"]
        if config.speculative == "auto" or draft is not None
        else None,
        speculative_draft=draft.name if draft is not None else None,
        speculative_k=config.speculative.get("k", DRAFT_K_DEFAULT) if draft is not None else None,
    )
    kv_disk = None
    if resolved.kv_disk:
        disk_bytes = parse_bytes(config.kv_disk_bytes, "kv_disk_bytes")
        kv_disk = open_kv_disk(
            resolved, disk_bytes, files, hf_config, model.head_dim, attention, device, dtype, kv_dtype
        )
        resolved = dataclasses.replace(resolved, kv_disk=kv_disk is not None)
    return EngineParts(
        files.name,
        files.folder,
        model,
        tokenizer,
        attention,
        device,
        kv_dtype,
        num_blocks,
        block_bytes,
        stop_token_ids(tokenizer, hf_config),
        kv_disk,
        resolved,
        draft,
    )
