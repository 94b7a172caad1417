"""Shared-prefix ("cascade") attention in the engine: greedy tokens with it on equal those with it off, token for
token, for sequences sharing a long prompt, batched and alone; the steps really ran with groups; blocks all return."""

from __future__ import annotations

import pytest

from localpaged import LLM, SamplingParams
from localpaged.kernels import cpu
from tests.engine.test_cpu_decode import NEEDS_VNNI

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler or no 64-bit CPU: no native kernels")

PROMPT = [(37 * i) % 40000 + 100 for i in range(300)]  # 18 whole blocks and some
QUESTIONS = [[5000 + 13 * j + i for i in range(3 + 5 * j)] for j in range(5)]


def small_groups(llm: LLM) -> LLM:
    """Groups of two sequences and 4 blocks count (the engine's thresholds are for speed, not for correctness)."""
    llm.runner.cascade_tiers = ((4, 2),)
    return llm


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def counting_plans(llm: LLM) -> list[int]:
    """Wraps ``llm.runner.cascade_plan``: the list fills with the members each step's plan grouped."""
    members: list[int] = []
    real = llm.runner.cascade_plan

    def counted(tables, limits):
        plan = real(tables, limits)
        members.append(0 if plan is None else len(plan.members))
        return plan

    llm.runner.cascade_plan = counted
    return members


@pytest.mark.parametrize(
    "kv_cache_dtype,activations,native_decode",
    [
        ("float32", "float32", True),
        ("float16", "float32", True),
        ("bfloat16", "float32", False),  # decode through the modules: cpu.paged_decode with the plan
        pytest.param("float16", "int16", True, marks=NEEDS_VNNI),  # int16 prefill products: the decode steps group
    ],
)
def test_greedy_tokens_with_cascade_equal_those_without(native_llama, kv_cache_dtype, activations, native_decode):
    llm = LLM(
        str(native_llama),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        activations=activations,
        kv_cache_memory="64MiB",
        max_model_len=512,
        kv_disk=False,
        max_num_batched_tokens=64,  # chunked prefills of several members meet in one step
    )
    small_groups(llm)
    assert llm.runner.cascade
    if not native_decode:
        llm.runner.native_decode = None
    prompts = [PROMPT + q for q in QUESTIONS]
    generate(llm, [PROMPT], 1)  # the shared prompt into the prefix cache
    members = counting_plans(llm)
    batched = generate(llm, prompts)
    assert max(members) == len(prompts), "no step grouped every sequence"
    alone = [generate(llm, [p])[0] for p in prompts]
    llm.runner.cascade = False
    assert generate(llm, prompts) == batched
    assert [generate(llm, [p])[0] for p in prompts] == alone == batched
    assert llm.stats().blocks_used == 0
    llm.close()


def test_forks_and_two_prompts_batch_as_several_groups(native_llama):
    """Two system prompts (each with two users) and two forks of one user's chat in one batch: several groups a
    step, the same tokens as without."""
    llm = LLM(str(native_llama), dtype="float32", kv_cache_memory="64MiB", max_model_len=512, kv_disk=False)
    small_groups(llm)
    other = [(53 * i) % 30000 + 7000 for i in range(200)]
    generate(llm, [PROMPT, other], 1)
    chat = PROMPT + QUESTIONS[4] + generate(llm, [PROMPT + QUESTIONS[4]], 40)[0]
    prompts = [PROMPT + QUESTIONS[0], PROMPT + QUESTIONS[1], other + QUESTIONS[2], other + QUESTIONS[3]]
    prompts += [chat + [9000 + i] for i in range(2)]
    plans: list[int] = []
    real = llm.runner.cascade_plan
    llm.runner.cascade_plan = lambda *entries: plans.append(p := real(*entries)) or p
    with_cascade = generate(llm, prompts)
    assert max(len(p.shared_lens) for p in plans if p is not None) >= 2
    llm.runner.cascade = False
    assert generate(llm, prompts) == with_cascade
    assert llm.stats().blocks_used == 0
    llm.close()


def test_off_builds_no_plan(native_llama):
    llm = LLM(str(native_llama), dtype="float32", kv_cache_memory="64MiB", max_model_len=512, cascade_attention=False)
    assert not llm.runner.cascade
    members = counting_plans(llm)
    generate(llm, [PROMPT + q for q in QUESTIONS[:2]], 3)
    assert members == []
    llm.close()


@pytest.mark.model
def test_the_default_model_on_its_defaults_gives_the_same_tokens_with_groups():
    """The default model with the CPU's defaults (float16 KV, int16 activations where VNNI runs) and the engine's own
    group thresholds: 16 users on a shared prompt of over 64 blocks decode in one group, and every greedy token is
    the one cascade attention off gives, batched and alone."""
    from tests.conftest import DEFAULT_MODEL, DEVICE

    llm = LLM(DEFAULT_MODEL, device=DEVICE, kv_cache_memory="512MiB", max_model_len=2048, kv_disk=False)
    words = [
        "the",
        "paged",
        "cache",
        "keeps",
        "every",
        "block",
        "of",
        "a",
        "shared",
        "system",
        "prompt",
        "once",
        "for",
        "all",
        "of",
        "its",
        "users;",
    ]
    shared = llm.tokenizer.encode(" ".join(words[i % len(words)] for i in range(1200)), add_special_tokens=False)
    shared = shared[: 64 * 16 + 40]
    prompts = [shared + llm.tokenizer.encode(f" Question {j}: what is block {7 * j}?") for j in range(16)]
    generate(llm, [shared], 1)  # the shared prompt into the prefix cache, as a first user leaves it
    members = counting_plans(llm)
    batched = generate(llm, prompts, 16)
    assert max(members) == len(prompts), "the engine's thresholds formed no group of all the users"
    llm.runner.cascade = False
    assert generate(llm, prompts, 16) == batched
    assert [generate(llm, [p], 16)[0] for p in prompts[:4]] == batched[:4]
    assert llm.stats().blocks_used == 0
    llm.close()
