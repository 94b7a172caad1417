"""Penalties, logit_bias, min_p and logprobs: the sampler against transformers' processors and plain references,
and the engine on the tiny model against transformers' generate and logits."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged import SamplingParams
from localpaged.engine.sampler import (
    SampledToken,
    _sample_row,
    apply_min_p,
    apply_penalties,
    draw,
    draw_rows,
    likeliest,
    make_generator,
    sample,
)
from localpaged.engine.sequence import Sequence
from localpaged.errors import RequestError
from tests.oracle import load_hf

CPU = torch.device("cpu")
# Float32 log-softmax of the same model's logits on two implementations (ours, transformers') stays within this.
LOGPROB_TOL = 1e-4


def _seq(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    """A sequence as the sampler sees it at a step: the prompt, the reply so far, its generator."""
    seq = Sequence("r", list(prompt), params)
    seq.token_ids.extend(output)
    seq.extra = SimpleNamespace(generator=make_generator(params, CPU), history=None)
    return seq


def _random(rows: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3, g


# ----- the processors against transformers' and OpenAI's definitions -------------------------------------


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits, g = _random(8, 64)
    seqs, expected = [], []
    for i, penalty in enumerate([0.5, 0.8, 1.2, 1.5, 2.0, 3.0, 1.1, 9.0]):
        ids = torch.randint(0, 64, (5 + 3 * i,), generator=g).tolist()
        seqs.append(_seq(SamplingParams(temperature=0, repetition_penalty=penalty), ids[:4], ids[4:]))
        expected.append(RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[i : i + 1].clone())[0])
    ours = logits.clone()
    apply_penalties(ours, seqs)
    torch.testing.assert_close(ours, torch.stack(expected))


def test_min_p_matches_transformers_after_temperature():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    logits, _ = _random(6, 200, seed=1)
    settings_ = [(0.5, 0.05), (1.0, 0.1), (1.5, 0.2), (0.7, 0.5), (2.0, 0.01), (1.0, 1.0)]
    params = [SamplingParams(temperature=t, min_p=m) for t, m in settings_]
    ours = logits.clone()
    apply_min_p(ours, params)
    ids = torch.tensor([[0]])
    for i, (t, m) in enumerate(settings_):
        theirs = MinPLogitsWarper(m)(ids, TemperatureLogitsWarper(t)(ids, logits[i : i + 1].clone()))[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(theirs)), f"row {i}: min_p={m} at temperature {t}"
        kept = ~torch.isinf(ours[i])
        assert torch.equal(ours[i][kept], logits[i][kept])  # what min_p keeps is untouched
    assert int((~torch.isinf(ours[5])).sum()) == 1  # min_p 1 keeps the likeliest alone


def test_min_p_leaves_greedy_rows_alone():
    logits, _ = _random(2, 50)
    work = logits.clone()
    apply_min_p(work, [SamplingParams(temperature=0, min_p=0.9), SamplingParams(top_k=1, min_p=0.9)])
    assert torch.equal(work, logits)


def test_presence_and_frequency_penalties_follow_openai():
    """logit -= presence * (count > 0) + frequency * count, counted over the reply only (not the prompt)."""
    logits, _ = _random(3, 16, seed=2)
    prompt = [1, 1, 1, 7]
    replies = [[3, 3, 5], [], [9, 9, 9, 9, 2]]
    settings_ = [(0.5, 0.0), (1.0, 1.0), (-0.5, 1.5)]
    seqs = [
        _seq(SamplingParams(temperature=0, presence_penalty=pp, frequency_penalty=fp), prompt, out)
        for (pp, fp), out in zip(settings_, replies)
    ]
    ours = logits.clone()
    apply_penalties(ours, seqs)
    expected = logits.clone()
    for i, ((pp, fp), out) in enumerate(zip(settings_, replies)):
        for token, count in Counter(out).items():
            expected[i, token] -= pp + fp * count
    torch.testing.assert_close(ours, expected)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    rows=st.integers(1, 6),
)
def test_penalties_and_bias_equal_a_plain_reference(data, vocab, rows):
    """Bias first, then repetition over prompt and reply, then presence/frequency over the reply (vLLM's order)."""
    token = st.integers(0, vocab - 1)
    seqs = []
    for _ in range(rows):
        prompt = data.draw(st.lists(token, min_size=1, max_size=12))
        reply = data.draw(st.lists(token, max_size=20))
        params = SamplingParams(
            temperature=0,
            presence_penalty=data.draw(st.sampled_from([0.0, -2.0, 0.3, 2.0])),
            frequency_penalty=data.draw(st.sampled_from([0.0, -1.0, 0.7, 2.0])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 10.0])),
            logit_bias=data.draw(st.dictionaries(token, st.floats(-100, 100), max_size=4)),
        )
        seqs.append(_seq(params, prompt, reply))
    logits = torch.tensor(data.draw(st.lists(st.floats(-20, 20), min_size=rows * vocab, max_size=rows * vocab)))
    logits = logits.view(rows, vocab)
    ours = logits.clone()
    apply_penalties(ours, seqs)
    for i, seq in enumerate(seqs):
        p = seq.params
        row = logits[i].tolist()
        for t, b in p.logit_bias.items():
            row[t] += b
        for t in set(seq.token_ids):
            row[t] = row[t] * p.repetition_penalty if row[t] < 0 else row[t] / p.repetition_penalty
        for t, c in Counter(seq.output_token_ids).items():
            row[t] -= p.presence_penalty + p.frequency_penalty * c
        torch.testing.assert_close(ours[i], torch.tensor(row), rtol=1e-5, atol=1e-4)


def test_counts_kept_from_step_to_step_follow_the_reply():
    """Each request's counts grow with its reply (one token a step, or several at once) and stay exact."""
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5)
    seq = _seq(params, [3, 3, 8])
    for step in range(30):
        logits = torch.randn(1, 12, generator=g)
        ours = logits.clone()
        apply_penalties(ours, [seq])
        row = logits[0].tolist()
        for t in set(seq.token_ids):
            row[t] = row[t] * 1.5 if row[t] < 0 else row[t] / 1.5
        for t, c in Counter(seq.output_token_ids).items():
            row[t] -= 0.4 + 0.3 * c
        torch.testing.assert_close(ours[0], torch.tensor(row), msg=f"step {step}")
        seq.token_ids.extend(torch.randint(0, 12, (1 + step % 3,), generator=g).tolist())


# ----- sample(): tokens and logprobs ---------------------------------------------------------------------


def test_rows_without_features_take_the_plain_path_bit_for_bit():
    """In a batch with every feature beside them, plain rows sample exactly what today's path samples alone."""
    logits, _ = _random(8, 300, seed=3)
    plain = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=1.3, top_k=20, seed=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
    ]
    featured = [
        SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias={4: 5.0}),
        SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=1.0, seed=4),
        SamplingParams(temperature=0.7, frequency_penalty=2.0, logprobs=3, seed=5),
        SamplingParams(temperature=0, logprobs=0),
    ]
    params = [p for pair in zip(plain, featured) for p in pair]
    seqs = [_seq(p, [1, 2, 3], [4, 4, 5]) for p in params]
    got = sample(logits.clone(), seqs)
    for i in range(0, 8, 2):
        p = params[i]
        want = int(logits[i].argmax()) if p.greedy else _sample_row(logits[i], p, make_generator(p, CPU))
        assert got[i] == SampledToken(want), f"row {i}: {p}"


def test_a_draw_follows_the_probabilities_and_never_takes_a_token_of_probability_zero():
    """draw: each index as often as its probability says (within 5 standard deviations over 40,000 draws), the
    zeros at the ends and between never, and the same draws again from the same seed."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 1e-3, 0.249, 0.0])
    g = torch.Generator().manual_seed(7)
    n = 40_000
    counts = Counter(draw(probs, g) for _ in range(n))
    assert set(counts) <= {1, 3, 4, 5}
    for i, p in enumerate(probs.tolist()):
        assert abs(counts[i] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5 + 1, (i, counts[i], n * p)
    first, second = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [draw(probs, first) for _ in range(200)] == [draw(probs, second) for _ in range(200)]
    unnormalised = torch.tensor([0.0, 3.0, 1.0, 0.0])  # top-p's masked probabilities do not sum to 1
    assert {draw(unnormalised, g) for _ in range(2_000)} == {1, 2}
    one = torch.zeros(49_152)
    one[-1] = 1e-30
    assert draw(one, g) == 49_151  # the only token with any probability, at the very end


@pytest.mark.parametrize("spread", [0.5, 2.0, 8.0])  # flat (a sort of everything) to peaked (the top 64)
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_keeps_the_tokens_a_full_sort_keeps(spread, top_p):
    g = torch.Generator().manual_seed(int(spread * 10) + int(top_p * 1000))
    for _ in range(5):
        probs = torch.softmax(torch.randn(20_000, generator=g) * spread, dim=-1)
        values, ids = likeliest(probs, top_p)
        keep = values.cumsum(0) - values <= top_p
        ordered, order = probs.sort(descending=True)
        want = ordered.cumsum(0) - ordered <= top_p
        assert torch.equal(values[keep], ordered[want])  # the same values kept, in the same order
        edge = values[keep][-1]  # of values equal to the last one kept, a sort and a top-k may take others
        assert set(ids[keep][values[keep] > edge].tolist()) == set(order[want][ordered[want] > edge].tolist())
        assert int(keep.sum()) < len(ids) or len(ids) == len(probs)  # the first token dropped is among those returned


def test_top_p_rows_draw_in_one_batch_what_they_draw_alone_and_only_from_the_nucleus():
    """Top-p rows are drawn together natively or, where their nucleus is wider than the kernel looks, row by row;
    either way each row's token is the one it draws alone, and over many steps a peaked row's tokens come from its nucleus
    alone, each as often as its renormalised probability says (within 5 standard deviations)."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 3000, generator=g)
    logits[:3] *= 8  # peaked: a nucleus of a few tokens; the flat rows' reaches past what the kernel looks at
    params = [
        SamplingParams(temperature=t, top_p=q, seed=s)
        for t, q, s in [(0.7, 0.9, 1), (1.0, 0.5, 2), (1.3, 0.95, 3), (0.8, 0.9, 4), (1.0, 0.99, 5), (0.7, 0.3, 6)]
    ]
    seqs = [_seq(p, [1, 2]) for p in params]
    got = sample(logits.clone(), seqs)
    for i, p in enumerate(params):
        assert got[i] == SampledToken(_sample_row(logits[i], p, make_generator(p, CPU))), i
    generators = [make_generator(p, CPU) for p in params]
    undecided = [t is None for t in draw_rows(logits, list(range(6)), params, generators)]
    assert undecided == [False, False, False, True, True, False]  # each way taken
    row, p = logits[1], params[1]
    probs = torch.softmax(row / p.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = order[ordered.cumsum(0) - ordered <= p.top_p]
    want = probs[keep] / probs[keep].sum()
    seq = _seq(p, [1, 2])
    n = 4000
    counts = Counter(sample(row[None].clone(), [seq])[0].token_id for _ in range(n))
    assert set(counts) <= set(keep.tolist())
    for token, share in zip(keep.tolist(), want.tolist()):
        assert abs(counts[token] - n * share) <= 5 * (n * share * (1 - share)) ** 0.5 + 1, (token, counts[token])


def test_a_greedy_row_takes_the_first_of_tied_largest_as_argmax_does():
    """Greedy rows take max's indices (faster than argmax on the CPU): the first of tied largest logits, and a
    NaN's index where a row has one, as argmax gives, in float32 and in the half types a GPU hands over."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.zeros(3, 50, dtype=dtype)
        logits[0, [7, 3, 40]] = 2.0
        logits[1, 9] = float("nan")
        logits[1, 12] = 5.0
        logits[2] = -1.0
        got = sample(logits.clone(), [_seq(SamplingParams(temperature=0), [1]) for _ in range(3)])
        assert got == [SampledToken(3), SampledToken(9), SampledToken(0)]
        assert [t.token_id for t in got] == logits.float().argmax(dim=-1).tolist()


def test_logprobs_are_the_raw_distribution_whatever_changes_the_choice():
    logits, _ = _random(5, 120, seed=4)
    params = [
        SamplingParams(temperature=0, logprobs=5, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.5, logprobs=20, repetition_penalty=2.0, min_p=0.2, top_k=10, seed=1),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0, seed=2),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=1, frequency_penalty=2.0, seed=3),
    ]
    seqs = [_seq(p, [1, 2], [3, 3, 9]) for p in params]
    got = sample(logits.clone(), seqs)
    raw = torch.log_softmax(logits, dim=-1)
    assert got[0].token_id == 7  # the bias chose it, the logprobs are the model's
    for i, (p, out) in enumerate(zip(params, got)):
        if p.logprobs is None:
            assert out.logprob is None
            continue
        lp = out.logprob
        assert lp.token_id == out.token_id
        assert lp.logprob == pytest.approx(float(raw[i, out.token_id]), abs=1e-6)
        values, ids = torch.topk(raw[i], p.logprobs)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))  # likeliest first
    assert got[2].logprob.top == [] and got[2].logprob.logprob == pytest.approx(float(raw[2].max()), abs=1e-6)


def test_a_mask_comes_after_the_logprobs_and_before_the_bias():
    """A grammar's mask limits the choice, never the logprobs, and no bias brings a masked token back."""
    logits, _ = _random(2, 40, seed=6)
    raw = torch.log_softmax(logits, dim=-1)
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[3, 5, 11]] = True

    def mask(work: torch.Tensor) -> None:
        work.masked_fill_(~allowed, float("-inf"))

    params = [
        SamplingParams(temperature=0, logprobs=3, logit_bias={7: 100.0}),
        SamplingParams(temperature=1.0, seed=1, logprobs=3, repetition_penalty=2.0),
    ]
    got = sample(logits.clone(), [_seq(p, [5, 7]) for p in params], mask=mask)
    for i, out in enumerate(got):
        assert out.token_id in (3, 5, 11)
        assert out.logprob.logprob == pytest.approx(float(raw[i, out.token_id]), abs=1e-6)
        assert [t for t, _ in out.logprob.top] == torch.topk(raw[i], 3).indices.tolist()


def test_a_failing_row_fails_alone_with_logprobs_beside_it():
    logits, _ = _random(2, 30)
    logits[1] = float("nan")
    seqs = [
        _seq(SamplingParams(temperature=0, logprobs=2), [1]),
        _seq(SamplingParams(temperature=1.0, logprobs=2), [1]),
    ]
    got = sample(logits, seqs)
    assert isinstance(got[0], SampledToken) and got[0].logprob is not None
    assert isinstance(got[1], ValueError)


# ----- the engine on the tiny model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    from tests.oracle import exact_llm

    return exact_llm(tiny_model_path, max_model_len=1024)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_hf(tiny_model_path)


PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def test_logit_bias_forces_and_bans_tokens(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPT, greedy)[0].token_ids
    forced = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={42: 100}))
    assert forced[0].token_ids == [42] * 8
    banned = {t: -100.0 for t in set(plain)}
    outs = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias=banned),
            SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True, logit_bias=banned),
            greedy,
        ],
    )
    assert not set(outs[0].token_ids) & set(plain) and not set(outs[1].token_ids) & set(plain)
    assert outs[2].token_ids == plain
    assert llm.stats().blocks_used == 0


def test_logit_bias_beyond_the_vocabulary_is_refused(llm):
    with pytest.raises(RequestError, match="logit_bias names token 60000: token ids must be below 49152"):
        llm.generate(PROMPT, SamplingParams(logit_bias={60000: 1.0}))


def test_greedy_repetition_penalty_matches_transformers_generate(llm, hf):
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    for penalty in (1.3, 0.8):
        ours = llm.generate(
            [ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=penalty)
        )
        theirs = hf.generate(
            torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False, repetition_penalty=penalty
        )
        assert ours[0].token_ids == theirs[0, len(ids) :].tolist(), f"repetition_penalty={penalty}"


def test_logprobs_equal_transformers_log_softmax(llm, hf):
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, logprobs=3, presence_penalty=2.0),
    ]
    for out, p in zip(llm.generate([ids, ids], params), params):
        assert len(out.logprobs) == len(out.token_ids) == 12
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1].float()
        raw = torch.log_softmax(logits, dim=-1)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(float(raw[step, token]), abs=LOGPROB_TOL)
            assert [t for t, _ in lp.top] == torch.topk(raw[step], p.logprobs).indices.tolist()
            if p.greedy:
                assert lp.top[0] == (token, lp.logprob)


def test_logprobs_line_up_with_token_ids_through_the_stop_token(llm):
    """A stop token that ends the reply is the last of ``token_ids`` (not of the text): its logprob is the last."""
    eos = min(llm.stop_token_ids)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logprobs=2, logit_bias={eos: 100}))[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.text == ""
    assert [lp.token_id for lp in out.logprobs] == [eos]
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert plain.logprobs is None


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(llm):
    prompts = [f"{PROMPT} {i}" for i in range(16)]
    kinds = [
        {},
        {"repetition_penalty": 1.4},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"logit_bias": {100: 8.0, 200: -100.0}},
        {"min_p": 0.1},
        {"logprobs": 4},
        {"logprobs": 0, "repetition_penalty": 0.9, "min_p": 0.05},
        {},
    ]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, temperature=0 if i % 2 else 0.9, seed=i, **kinds[i % len(kinds)])
        for i in range(len(prompts))
    ]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate(prompt, p)[0]
        assert out.token_ids == alone.token_ids, p
        assert (out.logprobs is None) == (p.logprobs is None)
        if out.logprobs is not None:
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
            for a, b in zip(out.logprobs, alone.logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOL)
    plain = [i for i, p in enumerate(params) if not kinds[i % len(kinds)]]
    only_plain = llm.generate([prompts[i] for i in plain], [params[i] for i in plain])
    assert [o.token_ids for o in only_plain] == [together[i].token_ids for i in plain]
    assert llm.stats().blocks_used == 0
