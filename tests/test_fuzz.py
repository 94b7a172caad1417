"""Hostile input, generated: every case either works or fails with our own error, and leaves nothing behind.

The engine half drives ``LLM.generate``/``chat`` on the tiny random Llama with random SamplingParams
values of every type, random prompts (text, token ids, chat messages) and wrong types where a prompt
or params go; after each case ``check_integrity()`` holds, ``blocks_used`` is 0 and no request is
left. The CLI half runs ``localpaged``'s main in-process on a temporary home with random arguments
(text, bytes as the OS would hand them over, numbers), and prints random store contents (control
characters, NULs, lone surrogates, huge and non-finite numbers, written with plain sqlite3 as another
program could) through every command that reads the store: each exits 0, or 2 with one ``error:``
line. Bounded: the examples below run in well under a minute on two busy cores.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import sqlite3
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localpaged import LLM, AsyncLLM, SamplingParams, cli
from localpaged.chat.store import ChatStore
from localpaged.engine import messages as m
from localpaged.errors import LocalpagedError
from tests.conftest import DEVICE

FAST = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

VOCAB = 49152
# Any code point, lone surrogates (a JSON "\\ud800" escape) and control characters included.
CHARACTERS = st.characters(codec=None, exclude_categories=())
# 20 blocks of 16 tokens for sequences of up to 96: a few long requests preempt each other.
ENGINE = {"dtype": "float32", "device": DEVICE, "kv_cache_memory": "160KiB", "max_model_len": 96}
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=CHARACTERS, max_size=8),
    st.binary(max_size=8),
    st.lists(st.one_of(st.integers(-5, VOCAB + 5), st.text(max_size=4), st.none()), max_size=3),
)
# Values a caller could mean (edges included), for the cases that must reach the engine.
valid_fields = {
    "max_tokens": st.integers(1, 12),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 1e6)),
    "top_k": st.one_of(st.integers(0, 3), st.integers(0, 2**31 - 1)),
    "top_p": st.one_of(st.just(1.0), st.floats(1e-300, 1)),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
}
valid_params = st.fixed_dictionaries(
    {"max_tokens": valid_fields["max_tokens"]},  # always short: the default (256) would fill every context
    optional={name: value for name, value in valid_fields.items() if name != "max_tokens"},
).map(lambda kwargs: SamplingParams(**kwargs))
text = st.text(alphabet=CHARACTERS, max_size=40)
token_ids = st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.integers(0, VOCAB - 1)), max_size=30)
message = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["system", "user", "assistant"]), anything),
        "content": st.one_of(text, anything),
    }
)
messages = st.lists(message, max_size=4)
prompt = st.one_of(text, token_ids, messages)


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(str(tiny_model_path), **ENGINE)


def assert_clean(llm: LLM) -> None:
    assert llm.requests == {} and not llm.has_unfinished_requests()
    assert llm.stats().blocks_used == 0
    llm.pool.check_integrity()


@settings(max_examples=300, deadline=None)
@given(
    kwargs=st.fixed_dictionaries(
        {}, optional={name: st.one_of(value, anything) for name, value in valid_fields.items()}
    )
)
def test_sampling_params_of_any_type(kwargs: dict) -> None:
    """Every value is either taken (and then holds the field's type) or refused with a ConfigError."""
    try:
        params = SamplingParams(**kwargs)
    except LocalpagedError:
        return
    assert isinstance(params.max_tokens, int) and isinstance(params.top_k, int) and isinstance(params.seed, int | None)
    assert all(isinstance(v, float) and math.isfinite(v) for v in (params.temperature, params.top_p))
    assert all(isinstance(s, str) for s in params.stop) and all(type(t) is int for t in params.stop_token_ids)
    m.encode(m.Add("r", [1], dataclasses.asdict(params)))  # whatever is accepted can cross to the engine process


@FAST
@given(params=st.lists(valid_params, min_size=1, max_size=3), prompts=st.lists(prompt, min_size=1, max_size=4))
def test_generate_with_random_params_and_prompts(llm: LLM, params: list[SamplingParams], prompts: list) -> None:
    per_prompt = params[0] if len(params) == 1 else (params * len(prompts))[: len(prompts)]
    try:
        outputs = llm.generate(prompts, per_prompt)
    except LocalpagedError:
        pass
    else:
        assert len(outputs) == len(prompts)
        for out in outputs:
            assert out.finished and out.finish_reason in ("stop", "length"), out.error
            assert isinstance(out.text, str)
    assert_clean(llm)


@FAST
@given(
    conversations=st.one_of(messages, st.lists(messages, max_size=3), anything), params=st.one_of(st.none(), anything)
)
def test_chat_and_generate_with_wrong_types(llm: LLM, conversations, params) -> None:
    for call in (llm.chat, llm.generate):
        try:
            call(conversations, params if params is not None else SamplingParams(max_tokens=2))
        except LocalpagedError:
            pass
        assert_clean(llm)


@pytest.fixture(scope="module")
def front_end(tiny_model_path):
    """An AsyncLLM (its core on a thread) over an engine of its own: what the app, the server and scripts use."""
    engine = AsyncLLM(str(tiny_model_path), engine_process=False, **ENGINE)
    yield engine
    engine.shutdown()


@FAST
@given(prompt=st.one_of(prompt, anything), params=st.one_of(st.none(), valid_params))
def test_the_async_front_end_with_random_prompts(front_end: AsyncLLM, prompt, params) -> None:
    """Prompts are sent to the core as msgspec: text that is not Unicode or a huge id must fail as our error."""
    try:
        out = front_end.generate_text(prompt, params and dataclasses.replace(params, max_tokens=4))
    except LocalpagedError:
        pass
    else:
        assert out.finished and out.finish_reason in ("stop", "length")
    stats = front_end.stats()
    assert stats.blocks_used == 0 and stats.running == stats.waiting == 0
    assert len(front_end._streams) == 0  # no stream left registered by a request that could not be sent


# -- the CLI -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-home")


def run_cli(home: Path, argv: list[str], tty: bool = False) -> tuple[int, str, str]:
    """``localpaged argv`` in-process on ``home``: its exit code, stdout and stderr."""

    class Out(io.StringIO):
        def isatty(self) -> bool:
            return tty

    out, err = Out(), Out()
    old = os.environ.get("LOCALPAGED_HOME")
    os.environ["LOCALPAGED_HOME"] = str(home)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse's own usage errors
                code = exc.code
    finally:
        if old is None:
            del os.environ["LOCALPAGED_HOME"]
        else:
            os.environ["LOCALPAGED_HOME"] = old
    return code, out.getvalue(), err.getvalue()


def assert_clean_exit(code: int, out: str, err: str, tty: bool) -> None:
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.count("error:") == 1, err
    if tty:  # nothing from the store drives the terminal
        assert not any(c in out for c in "\x1b\x07\x08\r\x9b"), out


def os_argument(raw: bytes) -> str:
    """What Python hands main() for these bytes on the command line (no NUL can be in one)."""
    return os.fsdecode(raw.replace(b"\0", b""))


command = st.sampled_from(
    [
        ["sessions", "list"],
        ["sessions", "show"],
        ["sessions", "export"],
        ["sessions", "delete"],
        ["search"],
        ["prompts", "list"],
        ["prompts", "show"],
        ["config", "show"],
        ["config", "path"],
        [],
    ]
)
argument = st.one_of(
    st.binary(max_size=12).map(os_argument), text, st.integers().map(str), st.sampled_from(["--limit"])
)


@FAST
@given(command=command, args=st.lists(argument, max_size=3), tty=st.booleans())
def test_cli_with_random_arguments(home: Path, command: list[str], args: list[str], tty: bool) -> None:
    args = [a for a in args if "\0" not in a]  # the OS hands no NUL to a program
    code, out, err = run_cli(home, [*command, *args], tty)
    assert_clean_exit(code, out, err, tty)


# What another program can leave in a TEXT column: any UTF-8 text (control characters, NULs), or bytes
# that are not UTF-8 at all (written below with CAST(? AS TEXT)).
stored_text = st.one_of(st.text(max_size=30).map(str.encode), st.binary(max_size=30))
huge = st.one_of(
    st.floats(allow_nan=False), st.integers(-(2**63), 2**63 - 1), st.just(math.inf), st.just(-math.inf), st.none()
)


@FAST
@given(
    title=st.one_of(st.none(), stored_text),
    contents=st.lists(
        st.tuples(
            st.sampled_from(["system", "user", "assistant"]),
            stored_text,
            st.sampled_from(["complete", "partial", "error"]),
        ),
        max_size=3,
    ),
    error=st.one_of(st.none(), stored_text),
    when=huge,
    tokens=huge,
    tty=st.booleans(),
)
def test_every_reading_command_prints_any_store_contents(
    tmp_path_factory, title, contents, error, when, tokens, tty
) -> None:
    home = tmp_path_factory.mktemp("store")
    with ChatStore(home / "chats.db"):
        pass  # migrated; the rows below are written as another program could, past ChatStore's checks
    conn = sqlite3.connect(home / "chats.db")
    conn.execute(
        "INSERT INTO sessions (id, title, created, updated) VALUES ('s1', CAST(? AS TEXT), ?, ?)",
        (title, 0.0 if when is None else when, 0.0 if when is None else when),
    )
    for role, content, status in contents:
        conn.execute(
            "INSERT INTO messages (session_id, role, content, status, error, completion_tokens, prompt_tokens,"
            " created, updated, finish_reason)"
            " VALUES ('s1', ?, CAST(? AS TEXT), ?, CAST(? AS TEXT), ?, ?, ?, ?, 'length')",
            (role, content, status, error, tokens, tokens, 0.0 if when is None else when, 0.0),
        )
    conn.commit()
    conn.close()
    words = [w for w in (title or b"").decode("utf-8", "replace").split() if "\0" not in w][:1] or ["a"]
    for argv in (
        ["sessions", "list"],
        ["sessions", "show", "s1"],
        ["sessions", "export", "s1"],
        ["search", *words],
    ):
        code, out, err = run_cli(home, argv, tty)
        assert_clean_exit(code, out, err, tty)
