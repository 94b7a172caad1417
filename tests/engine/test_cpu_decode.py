"""A Llama decode step in one native call (models/llama_cpu_decode.py): the module path's logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.errors import KernelArgumentError
from localpaged.kernels import cpu
from localpaged.models.llama_cpu_decode import NativeDecode, llama_decode
from tests.gguf_models import MIXED_TYPES, NATIVE_TYPES, tiny_hf_model, write_gguf
from tests.oracle import exact_llm

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler or no 64-bit CPU: no native kernels")

NEEDS_VNNI = pytest.mark.skipif(not cpu.vnni_is_fast(), reason="integer activations need AVX-512 VNNI")


def logits_of_each_step(llm, prompts: list[list[int]], params: SamplingParams) -> tuple[list[torch.Tensor], list]:
    """Every step's logits and the outputs of ``llm.generate(prompts, params)``."""
    seen = []
    model = llm.runner.model
    real = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    try:
        outputs = llm.generate(prompts, params)
    finally:
        del model.compute_logits
    return seen, outputs


@pytest.mark.parametrize(
    "kv_cache_dtype,activations",
    [
        ("float32", "float32"),
        ("float16", "float32"),
        pytest.param("float16", "int16", marks=NEEDS_VNNI),
        pytest.param("float16", "int8", marks=NEEDS_VNNI),
    ],
)
def test_native_decode_steps_give_the_module_paths_logits_bit_for_bit(native_llama, kv_cache_dtype, activations):
    assert_native_steps_match_the_modules(native_llama, kv_cache_dtype, activations)


# Qwen2's QKV bias, Qwen3's q and k norms (and 128-wide heads), Phi-3's partial rotary (48 of 64 dimensions)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_native_decode_steps_of_other_families_give_the_module_paths_logits(arch, tmp_path, gguf_tokenizer):
    rope = {"partial_rotary_factor": 0.75} if arch == "phi3" else None
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_hf_model(arch, rope=rope), arch, NATIVE_TYPES, gguf_tokenizer)
    assert_native_steps_match_the_modules(path, "float16", "int16" if cpu.vnni_is_fast() else "float32")


def assert_native_steps_match_the_modules(path, kv_cache_dtype: str, activations: str) -> None:
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        activations=activations,
        kv_cache_memory="64MiB",
        max_model_len=512,
        speculative="off",  # one row a sequence, so both paths' steps line up
    )
    native = llm.runner.native_decode
    assert native is not None
    calls = {"native": 0}
    real_run = native.run

    def counted(*args):
        calls["native"] += 1
        return real_run(*args)

    native.run = counted
    # Three sequences of different lengths decode together; one ends early, so the batch shrinks mid-way.
    prompts = [[1], list(range(100, 150)), list(range(200, 231))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 24, 9)]
    ours, ours_out = logits_of_each_step(llm, prompts, params)
    llm.runner.native_decode = None  # the modules, kernel by kernel
    theirs, theirs_out = logits_of_each_step(llm, prompts, params)
    assert calls["native"] == 23  # every decode step (the first token of each comes from the prefill)
    assert [o.token_ids for o in ours_out] == [o.token_ids for o in theirs_out]
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"step {step}: logits differ by up to {(a - b).abs().max():.3g}"
    assert llm.stats().blocks_used == 0


def test_native_decode_applies_only_where_the_modules_would_call_its_kernels(native_llama, tmp_path, gguf_tokenizer):
    llm = exact_llm(native_llama)
    assert llm.runner.native_decode is not None
    model, attention = llm.runner.model, llm.runner.attention
    assert not NativeDecode.applies(model, type(attention)(native=False))  # torch attention
    proj = model.layers[1].mlp.down_proj
    proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features))
    try:
        assert not NativeDecode.applies(model, attention)  # a bias the step would not add
    finally:
        proj.bias = None
    with pytest.warns(UserWarning, match="Q2_K"):
        mixed = exact_llm(
            write_gguf(tmp_path / "mixed.gguf", tiny_hf_model("llama"), "llama", MIXED_TYPES, gguf_tokenizer)
        )
    assert mixed.runner.native_decode is None  # a float projection (Q2_K, F16): the modules run
    assert exact_llm(native_llama, weights="float").runner.native_decode is None


def test_a_wrong_input_is_refused_by_name_and_the_step_still_runs(native_llama):
    llm = exact_llm(native_llama)
    native = llm.runner.native_decode
    weights = native.weights
    hidden, half = weights.hidden, weights.head_dim // 2
    x, cos, sin = torch.zeros(1, hidden), torch.ones(1, half), torch.zeros(1, half)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match="x has rows of 8"):
        llama_decode(weights, torch.zeros(1, 8), cos, sin, torch.tensor([-1]), table, lens)
    with pytest.raises(KernelArgumentError, match=r"cos has shape \(1, 3\)"):
        llama_decode(weights, x, torch.ones(1, 3), sin, torch.tensor([-1]), table, lens)
    with pytest.raises(KernelArgumentError, match="lp_llama_decode: a slot_mapping entry is past the cache"):
        llama_decode(weights, x, cos, sin, torch.tensor([weights.num_blocks * 16]), table, lens)
    with pytest.raises(KernelArgumentError, match="lp_llama_decode: .*a block id is outside the cache"):
        llama_decode(weights, x, cos, sin, torch.tensor([-1]), table + weights.num_blocks, lens)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and llm.stats().blocks_used == 0
