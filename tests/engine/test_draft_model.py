"""Speculative decoding with a draft model (engine.draft): greedy output token for token the output without it, with
a different draft of the same vocabulary and with the target as its own draft (every draft kept: the draft's K/V are
right), alone, batched, after preemption and after a prefix-cache hit; the pool's blocks count the draft's K/V;
each bad setting one clear error."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from localpaged import LLM, SamplingParams
from localpaged.config import EngineConfig
from localpaged.engine.runner import ModelRunner
from localpaged.engine.sequence import Sequence
from localpaged.engine.speculative import (
    AUTO_MAX_ROWS,
    COST_STEPS,
    PAUSE_STEPS,
    PENDING,
    PLAIN_STEPS,
    Speculator,
)
from localpaged.errors import ConfigError
from localpaged.models.loader import load_config
from tests.conftest import DEVICE
from tests.engine.test_speculative import PROMPTS, assert_clean, ids

ENGINE = {"dtype": "float32", "device": DEVICE, "kv_cache_memory": "64MiB"}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def drafted(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], int, int]:
    """The token ids of ``prompts`` (batched), and the draft tokens proposed and kept meanwhile."""
    before = llm.stats()
    out = ids(llm.generate(prompts, params))
    after = llm.stats()
    return (
        out,
        after.spec_proposed_tokens - before.spec_proposed_tokens,
        after.spec_accepted_tokens - before.spec_accepted_tokens,
    )


@pytest.fixture(scope="module")
def engines(tiny_model_path, tiny_qwen2_path):
    """The tiny Llama without speculation, drafted by itself, and drafted by the tiny Qwen2 (same vocabulary). The
    drafted ones have no row budget: these tests check drafts batched over five chats, which the engine's own budget
    (a step's rows within AUTO_MAX_ROWS) would leave undrafted."""
    engines = {
        "off": LLM(str(tiny_model_path), speculative="off", **ENGINE),
        "self": LLM(str(tiny_model_path), speculative={"draft": str(tiny_model_path), "k": 3}, **ENGINE),
        "other": LLM(str(tiny_model_path), speculative={"draft": str(tiny_qwen2_path), "k": 4}, **ENGINE),
    }
    for name in ("self", "other"):  # nor do they weigh the drafts' time: the target as its own draft never pays
        engines[name].speculator.max_rows = None
        engines[name].speculator.weighs_cost = False
    return engines


@pytest.fixture(scope="module")
def expected(engines) -> list[list[int]]:
    return ids(engines["off"].generate(PROMPTS, GREEDY))


def test_the_target_as_its_own_draft_has_every_draft_kept_alone_and_batched(engines, expected):
    llm = engines["self"]
    for prompt, want in zip(PROMPTS[:2], expected):
        got, proposed, accepted = drafted(llm, [prompt])
        assert got == [want]
        assert accepted == proposed > 0
    got, proposed, accepted = drafted(llm, PROMPTS)
    assert got == expected
    assert accepted == proposed >= len(PROMPTS) * (GREEDY.max_tokens // 4)  # k = 3: a step yields 4 tokens
    assert_clean(llm)


def test_another_draft_of_the_vocabulary_gives_the_greedy_tokens_without_drafts(engines, expected):
    llm = engines["other"]
    assert [drafted(llm, [p])[0][0] for p in PROMPTS[:2]] == expected[:2]
    got, proposed, _ = drafted(llm, PROMPTS)
    assert got == expected and proposed > 0
    assert_clean(llm)


def test_the_draft_catches_up_after_a_prefix_cache_hit(engines):
    """The follow-up's prompt comes mostly from the prefix cache, which holds the target's K/V only: the draft
    computes it itself, and its drafts are still all kept."""
    llm, off = engines["self"], engines["off"]
    prompt = PROMPTS[2]
    reply = llm.generate([prompt], GREEDY)[0].token_ids
    follow_up = prompt + reply + [11, 12, 13]
    before = llm.stats()
    warm = llm.generate([follow_up], GREEDY)[0]
    after = llm.stats()
    assert warm.metrics.cached_tokens >= 64
    assert warm.token_ids == off.generate([follow_up], GREEDY)[0].token_ids
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted == after.spec_proposed_tokens - before.spec_proposed_tokens > 0
    assert_clean(llm)


def test_preempted_sequences_catch_up_and_stay_exact(tiny_model_path, engines, expected):
    """A pool of 20 blocks for four sequences of up to 8 blocks each: sequences are preempted and recomputed, and
    the draft (the target itself) catches up on their new blocks, every draft still kept."""
    off = engines["off"]
    block_bytes = 2 * off.block_bytes  # the target's K/V and the draft's, the same model's
    llm = LLM(
        str(tiny_model_path),
        speculative={"draft": str(tiny_model_path)},
        **{**ENGINE, "kv_cache_memory": 20 * block_bytes, "max_model_len": 256, "enable_prefix_caching": False},
    )
    assert llm.resolved.num_blocks == 20
    got, proposed, accepted = drafted(llm, PROMPTS[:4])
    assert got == expected[:4]
    assert llm.stats().preemptions > 0
    assert accepted == proposed > 0
    assert_clean(llm)


def test_the_pool_counts_the_drafts_kv_in_each_block(engines, tiny_model_path, tiny_qwen2_path):
    off, other = engines["off"], engines["other"]
    budget = 64 * 2**20
    target = off.block_bytes
    cfg = load_config(tiny_qwen2_path)
    draft = ModelRunner.bytes_per_block(
        cfg, cfg.hidden_size // cfg.num_attention_heads, 16, other.runner.kv_cache.dtype
    )
    assert other.block_bytes == target + draft
    assert other.resolved.num_blocks == budget // (target + draft) == other.pool.num_blocks
    assert off.resolved.num_blocks == budget // target
    assert other.runner.drafter.runner.kv_cache.shape[2] == other.pool.num_blocks  # the same block ids
    got = other.resolved
    assert (got.speculative, got.speculative_draft, got.speculative_k) == ("draft", tiny_qwen2_path.name, 4)
    assert got.speculative_max_rows == AUTO_MAX_ROWS["cpu"]  # as "auto": drafts stop where they cost more


def test_the_draft_setting_is_checked(tmp_path, tiny_model_path):
    for bad, message in [
        ({"draft": "x.gguf", "depth": 2}, "unknown key"),
        ({"k": 3}, "'draft' must name the draft model"),
        ({"draft": "x.gguf", "k": 0}, "'k' must be a whole number from 1 to 8"),
        ({"draft": "x.gguf", "k": 9}, "'k' must be a whole number from 1 to 8"),
        ({"draft": "x.gguf", "k": "3"}, "'k' must be a whole number from 1 to 8"),
        ({"draft": "x.gguf", "k": True}, "'k' must be a whole number from 1 to 8"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig(speculative=bad)
    assert EngineConfig(speculative={"draft": "x.gguf"}).speculative == {"draft": "x.gguf"}  # kept as given

    # The same model with two tokens' ids swapped: another vocabulary, refused by name before the weights load.
    other = shutil.copytree(tiny_model_path, tmp_path / "swapped")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["om"], vocab["il"] = vocab["il"], vocab["om"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="swapped: its vocabulary is not the target model's"):
        LLM(str(tiny_model_path), speculative={"draft": str(other)}, **ENGINE)
    short = shutil.copytree(tiny_model_path, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    with pytest.raises(ConfigError, match="short reads 512 positions, fewer than max_model_len=1024"):
        LLM(str(tiny_model_path), speculative={"draft": str(short)}, max_model_len=1024, **ENGINE)


def test_a_draft_model_owes_up_to_its_k_and_adapts_it():
    spec = Speculator("draft", k=5)
    s = Sequence("r", [1, 2, 3], SamplingParams(temperature=0.0))
    assert spec.drafts(s, room=100) == [PENDING] * 5  # it starts at its k
    assert spec.drafts(s, room=2) == [PENDING] * 2
    spec.verified(s, 5, 1)
    assert spec.drafts(s, room=100) == [PENDING] * 2
    spec.verified(s, 2, 2)
    spec.verified(s, 4, 4)
    assert s.spec.k == 5 and spec.spare_rows(3) == 15


def test_a_draft_model_that_costs_more_than_it_saves_rests_then_tries_again():
    spec = Speculator("draft", k=3)

    def drafted_steps(tokens: int, seconds: float) -> None:
        for _ in range(COST_STEPS):
            assert spec.spare_rows(1) == 3
            spec.step_timed(1, True, tokens, seconds)

    def rest() -> int:
        rested = 0
        while spec.spare_rows(1) == 0:
            spec.step_timed(1, False, 1, 0.01)  # a step without drafts: 100 tokens a second
            rested += 1
        return rested

    drafted_steps(4, 0.05)  # 80 tokens a second; no step without drafts timed yet: a few are taken first
    assert rest() == PLAIN_STEPS
    spec.step_timed(1, True, 4, 0.05)  # the verdict: drafting lost
    assert rest() == PAUSE_STEPS[0]
    drafted_steps(4, 0.05)  # still losing: it rests twice as long
    assert rest() == 2 * PAUSE_STEPS[0]
    drafted_steps(4, 0.02)  # 200 tokens a second: it keeps drafting, and a later rest starts short again
    assert spec.spare_rows(1) == 3 and spec.pause == PAUSE_STEPS[0]
    drafted_steps(4, 0.02)
    spec.step_timed(2, True, 2, 1.0)  # another batch size is weighed on its own (no verdict after one step)
    assert spec.spare_rows(1) == 3
    spec.weighs_cost = False  # switched off: nothing rests
    for _ in range(2 * COST_STEPS):
        spec.step_timed(1, True, 1, 1.0)
    assert spec.spare_rows(1) == 3


def test_a_slow_draft_model_stops_drafting_and_the_reply_is_unchanged(tiny_model_path, engines, expected):
    """A draft model that takes longer than it saves (here made slow: 0.2 s a propose) drafts COST_STEPS steps,
    takes PLAIN_STEPS without drafts to weigh them against, rests, tries again and rests twice as long."""
    llm = LLM(str(tiny_model_path), speculative={"draft": str(tiny_model_path), "k": 3}, **ENGINE)
    drafter = llm.runner.drafter
    propose = drafter.propose

    def slow(batch):
        propose(batch)
        if any(seq.spec_token_ids for seq in batch.seqs):
            time.sleep(0.2)  # 4 tokens a drafted step: under 20 a second, far below the tiny model's plain steps

    drafter.propose = slow
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    got, proposed, _ = drafted(llm, [PROMPTS[0]], params)
    assert got == ids(engines["off"].generate([PROMPTS[0]], params))
    # 120 tokens: 4 drafted steps weighed (a step that prefilled the draft is not: the first, and the first after a
    # rest), 4 without drafts, a 5th drafted (the verdict), 64 resting, 4 or 5 drafted, resting again; 30 steps of 3
    # drafts had it never rested
    assert 0 < proposed <= 2 * (COST_STEPS + 2) * 3
    llm.close()
