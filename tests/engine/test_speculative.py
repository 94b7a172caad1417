"""Speculative decoding (engine.speculative): greedy output token for token the output without it, alone and
batched, on the tiny model and the default one; sampled output from the target's distribution; refused drafts
leave no block held and nothing in the prefix cache; the policy's own rules; the setting."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from localpaged import LLM, SamplingParams
from localpaged.config import EngineConfig
from localpaged.engine.proposer import History
from localpaged.engine.sequence import Sequence
from localpaged.engine.speculative import K_MAX, K_START, Speculator
from localpaged.errors import ConfigError

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# Prompts that repeat themselves, so the n-gram proposer has something to offer, and some that do not.
PROMPTS = [
    list(range(300, 340)) * 3,
    [7, 8, 9, 10] * 20 + [7, 8],
    list(range(1000, 1064)),
    [42] * 30,
    [5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6],
]


def assert_clean(llm: LLM) -> None:
    assert llm.requests == {} and not llm.has_unfinished_requests()
    assert llm.stats().blocks_used == 0
    llm.pool.check_integrity()


def ids(outputs) -> list[list[int]]:
    return [out.token_ids for out in outputs]


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    """The tiny model with speculation off, with n-gram drafts, and with drafts from earlier replies too."""
    from tests.conftest import DEVICE

    def make(mode: str) -> LLM:
        return LLM(str(tiny_model_path), dtype="float32", device=DEVICE, kv_cache_memory="64MiB", speculative=mode)

    return {mode: make(mode) for mode in ("off", "ngram", "suffix")}


def test_greedy_tokens_with_drafts_equal_those_without_alone_and_batched(engines):
    off, on = engines["off"], engines["suffix"]
    expected = ids(off.generate(PROMPTS, GREEDY))
    before = on.stats()
    assert [ids(on.generate([p], GREEDY))[0] for p in PROMPTS] == expected  # alone
    assert ids(on.generate(PROMPTS, GREEDY)) == expected  # batched: each repeats a reply the history holds
    after = on.stats()
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > proposed // 2 > 0


def test_drafts_right_wrong_and_in_between_give_the_greedy_tokens_without_them(engines, monkeypatch):
    """Drafts from an oracle that knows each reply and spoils one draft in three at random: every mix of kept and
    refused drafts, of every length, alone and batched, on the "ngram" engine's verification path."""
    import random

    off, on = engines["off"], engines["ngram"]
    expected = ids(off.generate(PROMPTS, GREEDY))
    replies = {tuple(p): r for p, r in zip(PROMPTS, expected)}
    rng = random.Random(0)

    def oracle(seq, room):
        reply = replies[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        k = rng.randint(0, min(room, 6))
        true = reply[seq.num_output_tokens : seq.num_output_tokens + k]
        return [t if rng.random() > 1 / 3 else (t + 1) % 49152 for t in true]

    monkeypatch.setattr(on.speculator, "drafts", oracle)
    monkeypatch.setattr(on.speculator, "verified", lambda seq, proposed, accepted: counts.append((proposed, accepted)))
    counts: list[tuple[int, int]] = []
    assert [ids(on.generate([p], GREEDY))[0] for p in PROMPTS] == expected
    assert ids(on.generate(PROMPTS, GREEDY)) == expected
    assert any(a == p for p, a in counts) and any(a < p for p, a in counts) and any(0 < a < p for p, a in counts)
    assert_clean(on)
    assert_clean(on)
    assert off.stats().spec_proposed_tokens is None  # off: no speculation figures


def test_a_regenerated_reply_is_drafted_from_the_earlier_one(engines):
    """ "suffix" remembers replies: the same question again is proposed (and taken) nearly whole."""
    on = engines["suffix"]
    prompt = list(range(2000, 2050))
    first = on.generate([prompt], GREEDY)[0]
    before = on.stats()
    again = on.generate([prompt], GREEDY)[0]
    after = on.stats()
    assert again.token_ids == first.token_ids
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted >= len(first.token_ids) // 2
    steps = len(first.token_ids) - accepted  # each step yields its kept drafts and one token more
    assert steps < len(first.token_ids) // 2


def test_a_reply_taken_from_the_prefix_cache_after_drafts_is_the_same_as_computed_fresh(engines):
    """Blocks written while drafts were checked and refused hold the right K/V where the cache keeps them: a
    follow-up over the reply reads them from the cache and gives what an engine without drafts computes."""
    on, off = engines["ngram"], engines["off"]
    prompt = PROMPTS[0]
    reply = on.generate([prompt], GREEDY)[0].token_ids
    follow_up = prompt + reply + [11, 12, 13]
    warm = on.generate([follow_up], GREEDY)[0]
    assert warm.metrics.cached_tokens >= (len(prompt) + len(reply)) // 16 * 16 - 16
    on.pool.check_integrity()
    assert warm.token_ids == off.generate([follow_up], GREEDY)[0].token_ids


def test_stops_and_limits_end_a_reply_inside_its_drafts(engines):
    on, off = engines["ngram"], engines["off"]
    params = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[302]),
    ]
    for p in params:
        expected = off.generate([PROMPTS[0]], p)[0]
        got = on.generate([PROMPTS[0]], p)[0]
        assert (got.token_ids, got.finish_reason, got.text) == (
            expected.token_ids,
            expected.finish_reason,
            expected.text,
        )
    assert_clean(on)


def test_drafts_never_run_past_the_context(tiny_model_path):
    from tests.conftest import DEVICE

    llm = LLM(str(tiny_model_path), dtype="float32", device=DEVICE, kv_cache_memory="16MiB", max_model_len=64)
    out = llm.generate([[7, 8, 9, 10] * 14], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 56
    assert_clean(llm)


def test_drafts_give_way_before_anyone_is_preempted(tiny_model_path):
    """A pool too small for every sequence's drafts runs them without drafts, preempting no more than without."""
    from tests.conftest import DEVICE

    def run(mode: str) -> tuple[list[list[int]], int]:
        llm = LLM(str(tiny_model_path), dtype="float32", device=DEVICE, kv_cache_memory="1MiB", speculative=mode)
        out = ids(llm.generate(PROMPTS[:4], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
        assert_clean(llm)
        return out, llm.stats().preemptions

    (expected, preempted_off), (got, preempted_on) = run("off"), run("ngram")
    assert got == expected
    assert preempted_on <= preempted_off + 1


def test_sampled_tokens_with_drafts_keep_the_targets_distribution(engines):
    """Unseeded sampled requests speculate (drafts from the samples before them); the joint distribution of a reply's three tokens (the third is the first
    a kept draft can decide) matches the one without drafts (a chi-squared two-sample test over the outcomes seen, at a level a right engine fails once in 10^6)."""
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=2, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    n = 800

    def outcomes(llm: LLM) -> Counter:
        return Counter(tuple(out.token_ids) for out in llm.generate([prompt] * n, params))

    before = engines["suffix"].stats().spec_accepted_tokens
    a, b = outcomes(engines["off"]), outcomes(engines["suffix"])
    assert engines["suffix"].stats().spec_accepted_tokens > before + n // 10  # drafts from earlier samples, kept
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    statistic = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    dof = len(keys) - 1
    # Wilson-Hilferty: the chi-squared quantile at 1 - 1e-6 for dof degrees of freedom.
    z = 4.753
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert statistic < limit, (statistic, limit, a, b)


def test_seeded_penalized_and_constrained_requests_decode_without_drafts(engines):
    on = engines["ngram"]
    for params in [
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={9: 1.0}, ignore_eos=True),
    ]:
        before = on.stats().spec_proposed_tokens
        assert ids(on.generate([PROMPTS[1]], params)) == ids(engines["off"].generate([PROMPTS[1]], params))
        assert on.stats().spec_proposed_tokens == before


def test_greedy_logprobs_with_drafts_equal_those_without(engines):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    expected = engines["off"].generate([PROMPTS[1]], params)[0].logprobs
    got = engines["ngram"].generate([PROMPTS[1]], params)[0].logprobs
    assert [(t.token_id, [i for i, _ in t.top]) for t in got] == [(t.token_id, [i for i, _ in t.top]) for t in expected]
    assert all(math.isclose(g.logprob, e.logprob, abs_tol=1e-4) for g, e in zip(got, expected))


# -- the policy, torch-free ------------------------------------------------------------------------


def seq(tokens: list[int], **params) -> Sequence:
    return Sequence("r", tokens, SamplingParams(temperature=0.0, **params))


def test_k_grows_while_drafts_are_taken_whole_and_falls_to_what_was_taken():
    spec = Speculator("ngram")
    s = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    assert K_START == K_MAX == 3 and spec.drafts(s, room=100) == [3, 4, 5]
    spec.verified(s, 3, 0)
    assert spec.drafts(s, room=100) == [3]  # all refused: one draft next
    spec.verified(s, 1, 1)
    assert spec.drafts(s, room=100) == [3, 4]  # taken whole: twice as many, up to K_MAX
    spec.verified(s, 2, 2)
    assert s.spec.k == K_MAX
    assert spec.drafts(s, room=2) == [3, 4]  # never past the room the scheduler gives
    assert (spec.num_proposed, spec.num_accepted) == (6, 3)


def test_a_sequence_whose_drafts_keep_missing_waits_longer_each_time():
    spec = Speculator("ngram")
    s = seq([1, 2, 3, 1, 2])
    waits = []
    for _ in range(4):
        assert spec.drafts(s, room=10)
        spec.verified(s, 1, 0)
        wait = 0
        while not spec.drafts(s, room=10):
            wait += 1
        waits.append(wait)
    assert waits == [0, 1, 3, 7]
    spec.verified(s, 1, 1)  # a kept draft ends the waiting
    assert s.spec.misses == 0 and s.spec.idle == 0


def test_the_batch_limit_and_the_requests_that_cannot_speculate():
    spec = Speculator("ngram", max_rows=4)
    tokens = [1, 2, 3, 1, 2]
    assert [spec.spare_rows(n) for n in (1, 3, 4, 9)] == [3, 1, 0, 0]
    assert Speculator("ngram").spare_rows(5) == 5 * K_MAX  # explicit modes: every sequence its K_MAX
    assert spec.drafts(seq(tokens, repetition_penalty=1.1), room=10) == []
    sampled = Sequence("r", list(tokens), SamplingParams(temperature=1.0, seed=1))
    assert spec.drafts(sampled, room=10) == []
    assert spec.drafts(Sequence("r", list(tokens), SamplingParams(temperature=1.0)), room=10)


def test_suffix_drafts_come_from_an_earlier_reply_after_the_same_prompt_end():
    spec = Speculator("suffix")
    earlier = seq(list(range(100, 120)) + [50, 51, 52, 53, 54, 55])
    earlier.num_prompt_tokens = 20
    spec.finished(earlier)
    again = seq(list(range(100, 120)))
    assert spec.drafts(again, room=4) == [50, 51, 52]  # K_MAX of them


def test_history_keeps_its_newest_tokens_within_its_limit():
    history = History(2, 3, max_tokens=64)
    for start in range(0, 400, 20):
        history.add(list(range(start, start + 20)))
    assert len(history.tokens) <= 64
    assert history.propose([380, 381], k=3, at_least=2) == ([382, 383, 384], 2)
    assert history.propose([0, 1], k=3, at_least=2) == ([], 0)  # long dropped


def test_the_setting_is_checked_once_and_resolved_to_what_runs(tiny_llm):
    with pytest.raises(ConfigError, match=r"speculative='draft': use 'auto', 'off', 'ngram', 'suffix'"):
        EngineConfig(speculative="draft")
    assert EngineConfig().speculative == "auto"
    resolved = tiny_llm().resolved
    assert (resolved.speculative, resolved.speculative_max_rows) == ("suffix", 4)
    assert (tiny_llm(speculative="ngram").resolved.speculative_max_rows) is None


@pytest.mark.model
def test_default_model_greedy_replies_with_drafts_equal_those_without():
    """The user's default engine (the GGUF's own blocks on the native decode step), many prompts, alone and batched."""
    questions = [
        (
            "Rewrite this with the variable renamed to total:\n\nfor x in items:\n    count = count + x\n"
            "    print(count)\nreturn count"
        ),
        "Repeat after me exactly: the quick brown fox jumps over the lazy dog, the quick brown fox.",
        "What is the capital of France?",
        "List the numbers from 1 to 20, separated by commas.",
        "Write a haiku about the sea.",
        "Fix the bug: def add(a, b):\n    return a - b\n\ndef sub(a, b):\n    return a - b",
    ]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    off = LLM(kv_disk=False, speculative="off")
    expected = ids(off.generate(prompts, params))
    del off
    on = LLM(kv_disk=False, speculative="suffix")
    assert [ids(on.generate([p], params))[0] for p in prompts] == expected
    assert ids(on.generate(prompts, params)) == expected
    stats = on.stats()
    assert stats.spec_accepted_tokens > 0
    assert_clean(on)
