"""Structured outputs (xgrammar): replies match their schema, regex, choice or grammar; bad specs are refused before
anything is queued; constrained rows never change free rows; preemption, abort, a slow or failing compile.

On the tiny random model (the real tokenizer): its replies are nonsense but must still match, and the schemas here
are bounded (string lengths, integer ranges, array sizes), so every reply ends by its grammar well within max_tokens.
The tests marked ``model`` run the default model.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys
import threading
import weakref

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from localpaged import LLM, SamplingParams
from localpaged.engine.async_llm import AsyncLLM
from localpaged.engine.sequence import SequenceStatus
from localpaged.engine.structured import StructuredOutputManager, check_structured
from localpaged.errors import RequestError
from localpaged.sampling import StructuredOutputs
from tests.conftest import DEVICE

ENGINE = {"dtype": "float32", "device": DEVICE, "kv_cache_memory": "64MiB", "max_model_len": 1024}
FEW = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]},
    },
    "required": ["name", "age"],
}


# Bytes SmolLM2's vocabulary has no token for: text with them cannot be written (see the last test).
MISSING_BYTES = {4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)}


def json_params(schema=PERSON, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 400)
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(structured=StructuredOutputs(json=schema), **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_path) -> LLM:
    return LLM(str(tiny_model_path), **ENGINE)


def idle(llm: LLM) -> None:
    """Nothing is left queued or held: no request, no waiting grammar, no block."""
    assert not llm.requests and not llm._compiling and not llm.has_unfinished_requests()
    assert llm.stats().blocks_used == 0
    llm.pool.check_integrity()


# ---- replies match --------------------------------------------------------------------------------------------


# Seed 57 at 0.8 once sampled a raw \x05 into the bounded name (see the next test).
@pytest.mark.parametrize(
    "params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "seed": 57}]
)
def test_json_schema_replies_finish_stop_and_validate(llm, params):
    outs = llm.generate(["Describe a person:", "hello", "x"], json_params(**params))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    idle(llm)


@pytest.mark.parametrize("bound", [{"maxLength": 6}, {"minLength": 2}, {"minLength": 1, "maxLength": 3}])
def test_a_length_bounded_string_allows_no_raw_control_character(bound):
    """xgrammar's own rule for such a string lets a tab or a \x05 through, which no JSON parser takes."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"s": {"type": "string", **bound}}, "required": ["s"]}
    info = xgr.TokenizerInfo([b"a"], xgr.VocabType.RAW, vocab_size=1)
    compiled = xgr.GrammarCompiler(info).compile_grammar(check_structured(StructuredOutputs(json=schema)))

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('{"s": "ab') and accepts('{"s": "é€😀"}')
    assert not [c for c in range(32) if accepts('{"s": "a' + chr(c))]
    assert not accepts('{"s": "a"b')


# Bounded leaves, so that every value the grammar allows ends after a few tokens.
leaves = st.one_of(
    st.fixed_dictionaries({"type": st.just("string"), "maxLength": st.integers(0, 5)}),
    st.fixed_dictionaries({"type": st.just("integer"), "minimum": st.integers(-50, 0), "maximum": st.integers(1, 99)}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(
        st.one_of(st.text(max_size=4), st.integers(-9, 9), st.booleans()), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
)
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=6)


def _objects(children):
    return st.dictionaries(names, children, min_size=1, max_size=4).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {"type": "object", "properties": props, "required": sorted(required)}
        )
    )


schemas = st.recursive(
    leaves,
    lambda children: st.one_of(
        _objects(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    ),
    max_leaves=6,
)


@FEW
@given(schema=schemas, seed=st.one_of(st.none(), st.integers(0, 2**32)))
def test_generated_schemas_every_reply_validates(llm, schema, seed):
    params = json_params(schema, max_tokens=800, temperature=0.0 if seed is None else 1.0, seed=seed)
    out = llm.generate(["Answer in JSON:"], params)[0]
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)
    idle(llm)


def test_regex(llm):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)):
        params.structured, params.max_tokens = StructuredOutputs(regex=pattern), 64
        out = llm.generate(["email:"], params)[0]
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


def _writable(text: str) -> bool:
    """Whether every byte of ``text`` has a token of its own in the tiny model's (SmolLM2's) vocabulary."""
    return not set(text.encode()) & MISSING_BYTES


@FEW
@given(
    choices=st.lists(
        st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6),
        min_size=1,
        max_size=5,
        unique=True,
    ),
    seed=st.integers(0, 2**32),
)
def test_choice_is_one_of_the_strings_escapes_and_all(llm, choices, seed):
    assume(all(_writable(c) for c in choices))
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=seed, structured=StructuredOutputs(choice=choices))
    out = llm.generate(["Pick one:"], params)[0]
    assert out.finish_reason == "stop" and out.text in choices, (choices, out.text)


def test_ebnf_grammar(llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num ("+" | "*") num\nnum ::= [1-9] [0-9]?'
    for seed in range(4):
        params = SamplingParams(
            max_tokens=64, temperature=1.0, seed=seed, structured=StructuredOutputs(grammar=grammar)
        )
        out = llm.generate(["math:"], params)[0]
        assert out.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)?\)", out.text), out.text


def test_json_object_is_any_object(llm):
    params = SamplingParams(max_tokens=600, temperature=0.0, structured=StructuredOutputs(json_object=True))
    out = llm.generate(["{"], params)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # an unbounded object may run to max_tokens: then it is cut, and its opening is still an object's
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")


def test_max_tokens_cuts_mid_object_with_length(llm):
    out = llm.generate(["Describe a person:"], json_params(max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_stop_strings_still_apply(llm):
    full = llm.generate(["Describe a person:"], json_params())[0].text
    cut = llm.generate(["Describe a person:"], json_params(stop=['"age"']))[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index('"age"')]


def test_the_grammar_end_stops_even_with_ignore_eos(llm):
    out = llm.generate(
        ["Pick:"],
        SamplingParams(
            max_tokens=50, temperature=0.0, ignore_eos=True, structured=StructuredOutputs(choice=["yes", "no"])
        ),
    )[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


# ---- bad specs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, match",
    [
        (StructuredOutputs(json={"type": "nope"}), r"JSON schema was refused \(Unsupported type"),
        (StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}}), "JSON schema was refused"),
        (StructuredOutputs(regex="a(b"), r"regex was refused \(Regex parsing error"),
        (StructuredOutputs(grammar="root ::= foo"), r"EBNF grammar was refused \(.*Rule \"foo\" is not defined"),
        (StructuredOutputs(grammar='start ::= "a"'), "EBNF grammar was refused"),
    ],
)
def test_bad_specs_are_refused_before_anything_is_queued(llm, spec, match):
    with pytest.raises(RequestError, match=match) as caught:
        llm.add_request("hello", SamplingParams(max_tokens=4, structured=spec))
    assert ".cc:" not in str(caught.value)  # xgrammar's source location is not the user's business
    with pytest.raises(RequestError, match=match):
        llm.generate(["fine", "hello"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured=spec)])
    idle(llm)


# ---- isolation -------------------------------------------------------------------------------------------------


def test_constrained_rows_never_change_free_rows(llm):
    free = [
        ("Tell me a story", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
        ("Once upon a time", SamplingParams(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True)),
    ]
    alone = llm.generate([p for p, _ in free], [sp for _, sp in free])
    constrained = [
        ("Describe a person:", json_params()),
        (
            "email:",
            SamplingParams(
                max_tokens=40, temperature=1.0, seed=5, structured=StructuredOutputs(regex="[a-z]{1,8}@x\\.org")
            ),
        ),
    ]
    mixed = llm.generate(
        [constrained[0][0], free[0][0], constrained[1][0], free[1][0]],
        [constrained[0][1], free[0][1], constrained[1][1], free[1][1]],
    )
    assert [mixed[1].token_ids, mixed[3].token_ids] == [a.token_ids for a in alone]
    jsonschema.validate(json.loads(mixed[0].text), PERSON)
    assert re.fullmatch("[a-z]{1,8}@x\\.org", mixed[2].text)
    idle(llm)


def test_preemption_mid_object_keeps_the_matcher_right(tiny_model_path):
    people = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}  # replies of a hundred tokens or more
    config = {**ENGINE, "max_model_len": 384}
    prompts = [f"Person number {i} is described as follows:" for i in range(5)]
    params = json_params(people, max_tokens=370)
    expected = [o.text for o in LLM(str(tiny_model_path), **config).generate(prompts, params)]
    small = LLM(str(tiny_model_path), **{**config, "kv_cache_memory": "128KiB"})  # 32 blocks for 5 long replies
    outs = small.generate(prompts, params)
    assert small.stats().preemptions > 0
    assert [o.text for o in outs] == expected
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), people)
    idle(small)


def test_abort_frees_blocks_and_the_matcher(llm):
    rid = llm.add_request("Describe a person:", json_params())
    while not llm.requests[rid][0].output_token_ids:
        llm.step()
    matcher = weakref.ref(llm.requests[rid][0].extra.grammar.matcher)
    llm.abort(rid)
    gc.collect()
    assert matcher() is None
    idle(llm)


class Gate:
    """Holds every compile until opened, and counts the compiles that started: a slow compile made observable."""

    def __init__(self, monkeypatch):
        self.opened = threading.Event()
        self.started = 0
        compile_ = StructuredOutputManager._compile

        def held(manager, kind, grammar):
            self.started += 1
            self.opened.wait(timeout=120)  # a failing test never leaves the compile worker (and exit) hanging
            return compile_(manager, kind, grammar)

        monkeypatch.setattr(StructuredOutputManager, "_compile", held)


def test_a_slow_compile_does_not_stall_other_requests(tiny_model_path, monkeypatch):
    gate = Gate(monkeypatch)
    llm = LLM(str(tiny_model_path), **ENGINE)
    schema = {
        "type": "object",
        "properties": {f"field{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(40)},
    }
    slow = llm.add_request("big schema:", json_params(schema))
    free = llm.add_request("free", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    done = {}
    while free not in done:
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert gate.started == 1 and not gate.opened.is_set()  # the free request finished while the compile was held
    assert llm.requests[slow][0].status is SequenceStatus.WAITING_FOR_FSM and not llm.requests[slow][0].output_token_ids
    assert llm.stats().blocks_used == 0  # the waiting request holds no blocks
    gate.opened.set()
    while slow not in done:
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert done[slow].finish_reason == "stop"
    jsonschema.validate(json.loads(done[slow].text), schema)
    idle(llm)


def test_same_spec_compiles_once_and_abort_while_compiling(tiny_model_path, monkeypatch):
    gate = Gate(monkeypatch)
    llm = LLM(str(tiny_model_path), **ENGINE)
    ids = [llm.add_request(f"p{i}", json_params()) for i in range(3)]
    llm.step()
    llm.abort(ids[0])  # while its grammar compiles
    gate.opened.set()
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step() if o.finished})
    assert gate.started == 1 and sorted(outs) == sorted(ids[1:])
    assert all(o.finish_reason == "stop" for o in outs.values())
    idle(llm)


def test_a_failed_compile_ends_that_request_alone(tiny_model_path, monkeypatch):
    def broken(manager, kind, grammar):
        raise RequestError("structured outputs: the JSON schema was refused (out of memory); simplify it")

    monkeypatch.setattr(StructuredOutputManager, "_compile", broken)
    llm = LLM(str(tiny_model_path), **ENGINE)
    bad, good = llm.generate(
        ["a", "b"], [json_params(), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)]
    )
    assert bad.finish_reason == "error" and "could not be compiled" in bad.error and "simplify it" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 8
    idle(llm)


def test_padded_vocabulary_ids_are_never_allowed(default_model_folder):
    """The logits may be wider than the tokenizer: ids past it, like special tokens, are masked for a grammar."""
    from localpaged.engine.engine_tokenizer import load_engine_tokenizer

    tokenizer = load_engine_tokenizer(default_model_folder)
    size = len(tokenizer.full)
    vocab = size + 64
    manager = StructuredOutputManager(tokenizer, vocab, {0, 2}, 2, torch.device("cpu"))
    request = manager.request(StructuredOutputs(regex="[^x]*"))
    request.future.result()
    assert request.start()
    logits = torch.zeros(2, vocab)
    logits[:, size:] = 100.0
    manager.apply_bitmask(logits, [1], [request])
    assert torch.isfinite(logits[0]).all()  # the other row is untouched
    assert torch.isinf(logits[1, size:]).all() and torch.isinf(logits[1, 1])  # padding, <|im_start|>
    assert torch.isfinite(logits[1, [0, 2]]).all()  # the stop tokens end the reply


def test_a_grammar_reads_the_vocabulary_of_the_record_as_of_the_full_tokenizer(default_model_folder):
    """From a tokenizer record the compiler takes its vocabulary without loading transformers' tokenizer (seconds),
    and a grammar allows the tokens it allows from the full tokenizer: special tokens blanked, the stops kept."""
    from localpaged.engine.engine_tokenizer import EngineTokenizer, load_engine_tokenizer
    from localpaged.engine.tokenizer import load_tokenizer

    load_engine_tokenizer(default_model_folder)  # writes the record
    recorded = load_engine_tokenizer(default_model_folder)
    full = load_tokenizer(default_model_folder)
    assert recorded.backend is not None
    size = len(full)
    managers = [
        StructuredOutputManager(t, size, {0, 2}, 1, torch.device("cpu"))
        for t in (recorded, EngineTokenizer(default_model_folder, None, full.eos_token_id, None, full))
    ]
    specs = [
        StructuredOutputs(json=PERSON),
        StructuredOutputs(regex="[a-z ]+!"),
        StructuredOutputs(choice=["<|im_start|>", " x"]),
    ]
    for spec in specs:
        masks = []
        for manager in managers:
            request = manager.request(spec)
            request.future.result()
            assert request.start()
            logits = torch.zeros(1, size)
            manager.apply_bitmask(logits, [0], [request])
            masks.append(torch.isinf(logits[0]))
        assert torch.equal(masks[0], masks[1]) and not masks[0].all(), spec
    assert recorded._full is None  # transformers' tokenizer was never loaded for it


# ---- AsyncLLM ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["process", "thread"])
def engine(request, tiny_model_path):
    engine = AsyncLLM(str(tiny_model_path), engine_process=request.param == "process", **ENGINE)
    yield engine
    engine.shutdown()


def test_async_llm_streams_a_valid_reply(engine, llm):
    async def collect():
        return [o async for o in engine.stream("Describe a person:", json_params())]

    outs = asyncio.run(collect())
    assert outs[-1].finish_reason == "stop" and "".join(o.delta for o in outs) == outs[-1].text
    jsonschema.validate(json.loads(outs[-1].text), PERSON)
    assert outs[-1].text == llm.generate(["Describe a person:"], json_params())[0].text
    assert list(
        engine.iter_stream(
            "email:", SamplingParams(max_tokens=30, structured=StructuredOutputs(choice=["a@b.c", "d@e.f"]))
        )
    )[-1].text in ("a@b.c", "d@e.f")
    assert engine.stats().blocks_used == 0


def test_async_llm_refuses_a_bad_spec_in_the_front_end(engine, monkeypatch):
    sent = []
    monkeypatch.setattr(engine, "_send", lambda message, quiet=False: sent.append(message))
    bad = SamplingParams(structured=StructuredOutputs(regex="(("))

    async def collect():
        return [o async for o in engine.stream("x", bad)]

    with pytest.raises(RequestError, match="regex was refused"):
        asyncio.run(collect())
    with pytest.raises(RequestError, match="regex was refused"):
        list(engine.iter_stream("x", bad))
    assert sent == [] and not engine._streams


# ---- the default model ---------------------------------------------------------------------------------------


@pytest.mark.model
def test_default_model_fills_a_schema(default_llm):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**9},
        },
        "required": ["city", "country", "population"],
    }
    chat = [{"role": "user", "content": "Give the capital of France as JSON with city, country and population."}]
    outs = default_llm.chat([chat, chat], [json_params(schema), json_params(schema, temperature=0.7, seed=1)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert "Paris" in outs[0].text
    choice = default_llm.chat(
        [[{"role": "user", "content": "Is the sky blue? Answer yes or no."}]],
        SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutputs(choice=["yes", "no"])),
    )[0]
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no")


@pytest.mark.model
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=schemas)
def test_default_model_generated_schemas_validate(default_llm, schema):
    chat = [{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(schema)}"}]
    out = default_llm.chat([chat], json_params(schema, max_tokens=600))[0]
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.model
def test_default_model_free_rows_unchanged_by_constrained_ones(default_llm):
    prompts = [[{"role": "user", "content": "Write a haiku about the sea."}]]
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = default_llm.chat(prompts, free)[0]
    both = default_llm.chat([prompts[0], [{"role": "user", "content": "A person as JSON."}]], [free, json_params()])
    assert both[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(both[1].text), PERSON)


def test_text_the_vocabulary_cannot_write_fails_that_request_alone(llm):
    """SmolLM2's vocabulary has no token for the byte 0xF1, so U+40000 cannot be written: a clear error, not NaNs."""
    outs = llm.generate(
        ["a", "b", "c"],
        [
            SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutputs(choice=["\U00040000"])),
            SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured=StructuredOutputs(regex="\U00040000")),
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        ],
    )
    for out in outs[:2]:
        assert out.finish_reason == "error" and "no token of this model's vocabulary can write" in out.error
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 8
    idle(llm)


def test_an_engine_without_structured_requests_never_loads_xgrammar(tiny_model_path):
    code = (
        "import sys; from localpaged import LLM, SamplingParams; "
        f"LLM({str(tiny_model_path)!r}, dtype='float32', device='cpu', kv_cache_memory='16MiB', max_model_len=256)"
        ".generate(['hi'], SamplingParams(max_tokens=2)); sys.exit(1 if 'xgrammar' in sys.modules else 0)"
    )
    # -P: the working folder (the checkout) off sys.path, where kernels/ would shadow the hub package transformers
    # imports (tests/conftest.py says more); the installed localpaged runs either way.
    assert subprocess.run([sys.executable, "-P", "-c", code], check=False, capture_output=True).returncode == 0
