"""SamplingParams: every field checked when built (ConfigError naming it), and importable without torch."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from localpaged.errors import ConfigError
from localpaged.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
    MIN_SEED,
    SamplingParams,
    StructuredOutputs,
)


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_tokens", 2.5),
        ("max_tokens", 8.0),
        ("max_tokens", True),
        ("max_tokens", "8"),
        ("max_tokens", None),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", MAX_TOKENS_LIMIT + 1),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 10**400),
        ("temperature", "0.7"),
        ("temperature", None),
        ("temperature", True),
        ("top_k", 2.5),
        ("top_k", -1),
        ("top_k", True),
        ("top_k", "5"),
        ("top_k", None),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_p", math.nan),
        ("top_p", -math.inf),
        ("top_p", "1"),
        ("top_p", None),
        ("top_p", True),
        ("seed", MIN_SEED - 1),
        ("seed", MAX_SEED + 1),
        ("seed", 1.5),
        ("seed", True),
        ("seed", "7"),
        ("stop", [1]),
        ("stop", 5),
        ("stop", ["a", None]),
        ("stop", {"a"}),
        ("stop", None),
        ("stop", b"x"),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [None]),
        ("stop_token_ids", "12"),
        ("stop_token_ids", 5),
        ("stop_token_ids", None),
        ("ignore_eos", 1),
        ("ignore_eos", "yes"),
        ("ignore_eos", None),
        ("n", 0),
        ("n", 65),
        ("n", 2.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0),
        ("repetition_penalty", 11),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("logit_bias", [1, 2]),
        ("logit_bias", None),
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("structured", "json"),
    ],
)
def test_bad_field_is_refused_naming_it_and_the_value(name, value):
    with pytest.raises(ConfigError, match=rf"^{name}=") as info:
        SamplingParams(**{name: value})
    assert repr(value)[:20] in str(info.value) or str(value) in str(info.value)


def test_valid_input_keeps_its_meaning():
    p = SamplingParams(
        stop="x", stop_token_ids=(5, np.int64(7)), temperature=1, seed=np.int32(3), max_tokens=np.int64(9)
    )
    assert p.stop == ["x"] and p.stop_token_ids == [5, 7] and p.seed == 3 and p.max_tokens == 9
    assert type(p.max_tokens) is int and type(p.seed) is int and all(type(t) is int for t in p.stop_token_ids)
    assert p.temperature == 1.0 and not p.greedy
    assert SamplingParams(stop=("a", "", "b")).stop == ["a", "b"]
    assert SamplingParams(stop="").stop == []
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(top_p=Fraction(1, 2)).top_p == 0.5
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED and SamplingParams(seed=0).seed == 0
    assert SamplingParams(seed=MIN_SEED).seed == MIN_SEED and SamplingParams(seed=-1).seed == -1  # any 64-bit seed
    assert SamplingParams(max_tokens=MAX_TOKENS_LIMIT).max_tokens == MAX_TOKENS_LIMIT


valid = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, MAX_TOKENS_LIMIT),
        "temperature": st.one_of(st.integers(0, 1000), st.floats(0, 1e300)),
        "top_k": st.integers(0, 10**9),
        "top_p": st.floats(0, 1, exclude_min=True),
        "seed": st.one_of(st.none(), st.integers(MIN_SEED, MAX_SEED)),
        "stop": st.one_of(
            st.text(max_size=MAX_STOP_CHARS),
            st.lists(st.text(max_size=MAX_STOP_CHARS), max_size=MAX_STOP_STRINGS),
            st.tuples(st.text(max_size=MAX_STOP_CHARS), st.text(max_size=MAX_STOP_CHARS)),
        ),
        "stop_token_ids": st.one_of(
            st.lists(st.integers(0, 10**9), max_size=MAX_STOP_TOKEN_IDS), st.tuples(st.integers(0, 10**9))
        ),
        "ignore_eos": st.booleans(),
        "n": st.integers(1, MAX_N),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 10, exclude_min=True),
        "min_p": st.floats(0, 1),
        "logit_bias": st.dictionaries(
            st.one_of(st.integers(0, 10**9), st.integers(0, 10**9).map(str)), st.floats(-100, 100), max_size=8
        ),
        "logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    },
)


@given(valid)
def test_any_valid_combination_constructs(kwargs):
    p = SamplingParams(**kwargs)
    assert isinstance(p.stop, list) and all(isinstance(s, str) and s for s in p.stop)
    assert isinstance(p.stop_token_ids, list) and all(type(t) is int and t >= 0 for t in p.stop_token_ids)
    assert type(p.max_tokens) is int and type(p.top_k) is int
    assert math.isfinite(p.temperature) and p.temperature >= 0 and 0 < p.top_p <= 1
    assert all(type(t) is int and type(b) is float for t, b in p.logit_bias.items())


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.fractions(),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3)), max_size=3),
    st.tuples(st.integers(), st.text(max_size=3)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = [
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "logprobs",
    "structured",
]


@given(st.dictionaries(st.sampled_from(FIELDS), anything))
def test_any_construction_succeeds_or_raises_config_error(kwargs):
    try:
        SamplingParams(**kwargs)
    except ConfigError:
        pass


def test_importing_sampling_params_does_not_import_torch():
    code = "import sys, localpaged.sampling; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, "importing localpaged.sampling pulled in torch " + result.stderr


def test_every_list_a_request_carries_is_bounded():
    """A request's stop checks run on the engine core after each of its tokens: their size is bounded up front."""
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(stop="y" * MAX_STOP_CHARS)
    with pytest.raises(ConfigError, match=f"^stop has 300000 strings: use at most {MAX_STOP_STRINGS}$"):
        SamplingParams(stop=["a"] * 300_000)
    with pytest.raises(ConfigError, match=f"has {MAX_STOP_CHARS + 1} characters: use at most {MAX_STOP_CHARS}"):
        SamplingParams(stop=["ok", "z" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ConfigError, match=f"^stop_token_ids has 1000 ids: use at most {MAX_STOP_TOKEN_IDS}$"):
        SamplingParams(stop_token_ids=list(range(1000)))
    with pytest.raises(ConfigError) as caught:
        SamplingParams(stop=[1] * 10)
    assert len(str(caught.value)) < 200  # the message quotes what was sent, cut short


def test_logit_bias_takes_json_keys_and_refuses_what_is_not_a_token_id():
    assert SamplingParams(logit_bias={"12": 5, 7: -100}).logit_bias == {12: 5.0, 7: -100.0}
    for key in ("-1", "1.5", "\u0661\u0662", "x", 1.0, True):  # "١٢" is digits to str.isdigit, not a token id
        with pytest.raises(ConfigError, match="^logit_bias key"):
            SamplingParams(logit_bias={key: 1})
    with pytest.raises(ConfigError, match=r"^logit_bias\['3'\]=101"):
        SamplingParams(logit_bias={"3": 101})
    with pytest.raises(ConfigError, match=f"use at most|bias at most {MAX_LOGIT_BIAS}"):
        SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)})


def test_structured_outputs_take_exactly_one_spec_and_cross_the_wire_as_a_dict():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = StructuredOutputs(json=schema)
    assert spec.kind == "json" and spec.key == StructuredOutputs(json=json.dumps(schema, sort_keys=True)).key
    assert StructuredOutputs(choice=("a", "b")).choice == ["a", "b"]
    assert SamplingParams(structured=dataclasses.asdict(spec)).structured == spec
    for bad, message in [
        ({}, "exactly one of"),
        ({"regex": "a+", "choice": ["a"]}, "exactly one of"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1]"}, "a schema is a JSON object"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "every choice is a non-empty string"),
        ({"regex": ""}, "non-empty string"),
        ({"json_object": 1}, "use True or False"),
    ]:
        with pytest.raises(ConfigError, match=message):
            StructuredOutputs(**bad)
    with pytest.raises(ConfigError, match="^structured="):
        SamplingParams(structured={"schema": schema})  # a dict of unknown fields, e.g. from a client's own naming
