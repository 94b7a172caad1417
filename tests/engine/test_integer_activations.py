"""Integer activations (``activations``): a GGUF's blocks take each matmul's input rounded per run to int16 (the
default where the CPU has AVX-512 VNNI) or to int8 (as llama.cpp does); greedy output stays close to the exact
path's (float32 activations), which the parity tests run."""

from __future__ import annotations

import pytest
import torch

from localpaged import LLM, SamplingParams
from localpaged.errors import ConfigError
from localpaged.kernels import cpu
from localpaged.layers.linear import TILE_PROMPT_MIN, BlockLinear, PromptRows
from tests.engine.test_parity import _prompts
from tests.oracle import exact_llm

NEEDS_VNNI = pytest.mark.skipif(not cpu.vnni_is_fast(), reason="no native kernels or no AVX-512 VNNI: refused")
# How far each prompt's first logits may move from the exact path's, as an RMS over their standard deviation, by
# activations and the chunked prefill's products: each bound sits about ten times above what the rounding itself
# gives on the tiny GGUF llama, and far below what a kernel reading the wrong weights gives (of the order of 1).
MOST_MOVED = {("int16", "float32"): 2e-3, ("int16", "int16"): 1.2e-2, ("int8", "int16"): 0.3}


def first_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of each prompt's first generated token."""
    seen: list[torch.Tensor] = []
    model = llm.runner.model
    real = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(real(hidden)) or seen[-1]
    try:
        for prompt in prompts:
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        del model.compute_logits
    return [logits[0] for logits in seen]


@NEEDS_VNNI
@pytest.mark.parametrize("activations,prefill_products", list(MOST_MOVED))
def test_integer_activations_pack_every_block_for_their_kernel_and_stay_near_the_exact_logits(
    native_llama, activations, prefill_products
):
    exact = exact_llm(native_llama, max_model_len=1024)
    llm = LLM(
        str(native_llama),
        dtype="float32",
        kv_cache_dtype="float32",
        activations=activations,
        kv_cache_memory="64MiB",
        max_model_len=1024,
    )
    assert llm.resolved.activations == activations and exact.resolved.activations == "float32"
    assert llm.runner.attention.prefill_products == "int16" and exact.runner.attention.prefill_products == "float32"
    llm.runner.attention.prefill_products = prefill_products
    blocks = [m for m in llm.runner.model.modules() if isinstance(m, BlockLinear)]
    assert blocks and all(m.packed.activations == activations for m in blocks)
    assert llm.runner.native_decode is not None  # decode steps in one native call, on the same kernel
    assert llm.kv_disk.layout.fingerprint != exact.kv_disk.layout.fingerprint  # their KV values differ
    prompts = _prompts(llm.tokenizer)
    for i, (ours, want) in enumerate(zip(first_logits(llm, prompts), first_logits(exact, prompts))):
        moved = float((ours - want).pow(2).mean().sqrt() / want.std())
        assert 0 < moved < MOST_MOVED[activations, prefill_products], f"prompt {i}: the logits moved by {moved:.3g}"


def test_auto_is_int16_where_vnni_runs_and_integer_activations_are_refused_where_they_cannot_pay(
    native_llama, tiny_model_path, monkeypatch
):
    def make(model, **config):
        return LLM(str(model), dtype="float32", kv_cache_memory="64MiB", max_model_len=512, **config)

    assert make(native_llama).resolved.activations == ("int16" if cpu.vnni_is_fast() else "float32")
    assert make(tiny_model_path).resolved.activations == "float32"  # float weights: nothing to round for
    for activations in ("int16", "int8"):
        for model, config in ((native_llama, {"weights": "float"}), (tiny_model_path, {})):
            with pytest.raises(ConfigError, match=f"activations='{activations}' applies to a GGUF's blocks"):
                make(model, activations=activations, **config)
    with pytest.raises(ConfigError, match="activations='int4': use 'auto', 'float32'"):
        LLM(str(native_llama), activations="int4")
    monkeypatch.setattr(cpu, "vnni_is_fast", lambda: False)  # a CPU without AVX-512 VNNI
    assert make(native_llama).resolved.activations == "float32"
    for activations in ("int16", "int8"):
        with pytest.raises(ConfigError, match=f"activations='{activations}' needs a CPU with AVX-512 VNNI"):
            make(native_llama, activations=activations)


@NEEDS_VNNI
def test_prompt_rows_reach_the_projections_marked_in_every_kind_of_step(native_llama):
    """Every row of a step that is a prompt token, and no other, is in the step's PromptRows: in whole and chunked
    prompts and in steps that also decode; a prompt of fewer than TILE_PROMPT_MIN tokens has none (its rows run as
    decoded ones); a step with a prompt row never takes the native decode step (its projections run every row as a
    decoded one)."""
    llm = LLM(str(native_llama), dtype="float32", kv_cache_memory="64MiB", max_model_len=512, max_num_batched_tokens=16)
    runner = llm.runner
    steps = []
    prepare, native = runner.prepare, runner.native_decode.run

    def watched(batch):
        # each sequence's rows this step and which of them are its prompt's, before prepare moves anything
        expected, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if seq.num_prompt_tokens >= TILE_PROMPT_MIN:
                expected += [row + j for j in range(n) if start + j < seq.num_prompt_tokens]
            row += n
        out = prepare(batch)
        meta = out[2]
        steps.append((expected, row, meta.prompt_rows))
        return out

    runner.prepare = watched
    runner.native_decode.run = lambda ids, pos, meta: (
        (pytest.fail("a step with prompt rows took the native decode step") if meta.prompt_rows is not None else None)
        or native(ids, pos, meta)
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.add_request(list(range(300, 340)), params)  # 40 prompt tokens: chunks of 16, 16 and 8
    llm.step()
    llm.step()
    llm.add_request(list(range(500, 523)), params)  # arrives while the first prompt still prefills; too short
    while llm.has_unfinished_requests():
        llm.step()
    kinds = set()
    for expected, rows, split in steps:
        if not expected:
            assert split is None
            kinds.add("decode")
            continue
        assert split.index.tolist() == expected
        if len(expected) == rows:
            assert split.rest is None
            kinds.add("prompt")
        else:
            assert sorted(expected + split.rest.tolist()) == list(range(rows))
            kinds.add("mixed")
    assert kinds == {"decode", "prompt", "mixed"}


@NEEDS_VNNI
def test_a_block_projection_runs_its_prompt_rows_as_prompt_rows_and_the_rest_as_decoded_ones(native_llama):
    llm = LLM(str(native_llama), dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    proj = next(m for m in llm.runner.model.modules() if isinstance(m, BlockLinear))
    x = torch.randn(10, proj.in_features, generator=torch.Generator().manual_seed(0))
    split = PromptRows.of([1, 4, 5, 9], 10, x.device)
    out = proj(x, split)
    assert torch.equal(out[split.index], cpu.qgemm(x[split.index], proj.packed, prompt=True))
    assert torch.equal(out[split.rest], cpu.qgemm(x[split.rest], proj.packed))
    assert torch.equal(proj(x, PromptRows.of(list(range(10)), 10, x.device)), cpu.qgemm(x, proj.packed, prompt=True))
    assert torch.equal(proj(x), cpu.qgemm(x, proj.packed))
