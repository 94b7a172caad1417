"""One bad request never affects another: failures inside a step end only their own request.

Failures are injected where they would really happen (a request's detokenizer, its sampling row,
the batched forward, a KeyboardInterrupt mid-step) on the tiny model; after each, the other
requests' greedy output must be what it is without the bad one, and every block must come back.
"""

from __future__ import annotations

import pytest

from localpaged import LLM, SamplingParams
from localpaged.errors import RequestError
from tests.conftest import DEVICE

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GOOD = ["hello", "the river flows", "count to ten"]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    # One token a step: the tests count steps (test_speculative covers failures with drafts).
    return LLM(
        str(tiny_model_path),
        dtype="float32",
        device=DEVICE,
        kv_cache_memory="32MiB",
        max_model_len=256,
        speculative="off",
    )


@pytest.fixture(scope="module")
def baseline(llm):
    """Greedy token ids of the good prompts, run without any bad request beside them."""
    return [o.token_ids for o in llm.generate(GOOD, GREEDY)]


def assert_clean(llm) -> None:
    """Nothing left behind: no request known, no block held, the pool consistent, new requests served."""
    assert llm.requests == {}
    assert not llm.has_unfinished_requests()
    assert llm.stats().blocks_used == 0
    llm.pool.check_integrity()
    out = llm.generate(["hello"], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert llm.stats().blocks_used == 0


def sabotage(llm, monkeypatch, prompt: str, method: str, after: int) -> None:
    """Make the detokenizer of every request for ``prompt`` raise on its ``after``-th call to ``method``."""
    make = llm._make_request

    def make_sabotaged(p, params, request_id):
        samples = make(p, params, request_id)
        if p == prompt:
            for seq in samples:
                detok = seq.extra.detokenizer
                real = getattr(detok, method)
                calls = 0

                def broken(*args, real=real, **kwargs):
                    nonlocal calls
                    calls += 1
                    if calls >= after:
                        raise RuntimeError("detokenizer exploded")
                    return real(*args, **kwargs)

                setattr(detok, method, broken)
        return samples

    monkeypatch.setattr(llm, "_make_request", make_sabotaged)


@pytest.mark.parametrize("method, after", [("add", 3), ("add", 1), ("take_delta", 4)])
def test_failing_request_ends_alone_with_its_error(llm, baseline, monkeypatch, method, after):
    sabotage(llm, monkeypatch, "BAD", method, after)
    outs = llm.generate([GOOD[0], "BAD", *GOOD[1:]], GREEDY)
    bad = outs[1]
    assert bad.finished and bad.finish_reason == "error"
    assert "processing its new token failed (RuntimeError: detokenizer exploded)" in bad.error
    assert bad.delta == "" and len(bad.token_ids) >= after - 1
    good = [outs[0], *outs[2:]]
    assert all(o.finish_reason == "length" and o.error is None for o in good)
    assert [o.token_ids for o in good] == baseline
    monkeypatch.undo()
    assert_clean(llm)


def test_failing_request_in_the_step_loop_leaves_the_others_streaming(llm, baseline, monkeypatch):
    sabotage(llm, monkeypatch, "BAD", "add", 2)
    for i, prompt in enumerate(GOOD):
        llm.add_request(prompt, GREEDY, request_id=f"good{i}")
    llm.add_request("BAD", GREEDY, request_id="bad")
    finals = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error" and "bad" not in llm.requests
    assert [finals[f"good{i}"].token_ids for i in range(len(GOOD))] == baseline
    monkeypatch.undo()
    assert_clean(llm)


def test_sampling_failure_of_one_row_fails_only_its_request(llm, baseline):
    """NaN probabilities in one row (as a model's NaN logits would give) fail that row's request alone."""
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    alone = llm.generate(["tell me"], seeded)[0].token_ids
    broken = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    broken.temperature = float("nan")  # past validation (a tiny temperature such as 1e-45 now decodes greedily)
    outs = llm.generate([*GOOD, "tell me", "tell me"], [GREEDY] * len(GOOD) + [broken, seeded])
    assert outs[3].finish_reason == "error" and outs[3].token_ids == []
    assert "sampling its next token failed (ValueError" in outs[3].error and "temperature=0" in outs[3].error
    assert [o.token_ids for o in outs[: len(GOOD)]] == baseline
    assert outs[4].token_ids == alone
    assert_clean(llm)


def test_batch_forward_failure_ends_its_batch_and_the_engine_goes_on(llm, monkeypatch):
    llm.add_request("the river flows", GREEDY, request_id="early")
    for _ in range(3):
        llm.step()
    llm.add_request("count to ten", GREEDY, request_id="late")

    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(llm.runner.model, "forward", boom)
    outs = {o.request_id: o for o in llm.step()}
    assert set(outs) == {"early", "late"}
    for out in outs.values():
        assert out.finished and out.finish_reason == "error"
        assert "the model step for this request's batch failed (RuntimeError: kernel exploded)" in out.error
    assert len(outs["early"].token_ids) == 3 and outs["late"].token_ids == []
    monkeypatch.undo()
    assert_clean(llm)


@pytest.mark.parametrize("where", ["forward", "token"])
@pytest.mark.parametrize("api", ["generate", "chat"])
def test_keyboard_interrupt_inside_a_step_aborts_every_request_of_the_call(llm, monkeypatch, where, api):
    calls = 0

    def interrupt_on_third_call(real):
        def wrapper(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        return wrapper

    if where == "forward":
        monkeypatch.setattr(llm.runner, "run", interrupt_on_third_call(llm.runner.run))
    else:
        monkeypatch.setattr(llm, "_on_token", interrupt_on_third_call(llm._on_token))
    with pytest.raises(KeyboardInterrupt):
        if api == "generate":
            llm.generate(GOOD, GREEDY)
        else:
            llm.chat([[{"role": "user", "content": p}] for p in GOOD], GREEDY)
    monkeypatch.undo()
    assert_clean(llm)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.runner.model.config.vocab_size
    with pytest.raises(RequestError, match=rf"stop_token_ids=\[{vocab}\].*below {vocab}"):
        llm.add_request("hello", SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(RequestError, match="stop_token_ids"):
        llm.generate(["hello", "there"], [GREEDY, SamplingParams(stop_token_ids=[1, 10**9])])
    assert_clean(llm)
