"""The engine core process under faults: killed mid-stream, orphaned, failing to start.

Real processes and real signals on the tiny model; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localpaged.chat.session import Session
from localpaged.chat.store import ChatStore
from localpaged.engine.async_llm import AsyncLLM
from localpaged.errors import ConfigError, EngineDeadError, ModelNotFoundError
from localpaged.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TINY = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "64MiB", "max_model_len": 1024}
LONG = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
DEATH_NOTICE_S = 2.0  # the bound: streams end, and an orphaned core exits, within this


def alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_killing_the_core_ends_every_stream_and_keeps_the_partial_replies(tiny_model_path: Path, tmp_path) -> None:
    engine = AsyncLLM(str(tiny_model_path), **TINY)
    core_pid = engine._core.process.pid
    with ChatStore(tmp_path / "chats.db") as store:
        sessions = [Session.new(engine, store) for _ in range(2)]
        seen: list[list[str]] = [[], []]
        killed_at: list[float] = []

        async def talk(i: int) -> BaseException | None:
            try:
                async for delta in sessions[i].astream(f"Tell me a very long story number {i}.", LONG):
                    seen[i].append(delta)
                    if len(seen[0]) >= 10 and seen[1] and not killed_at:  # both replies have text to keep
                        killed_at.append(time.monotonic())
                        os.kill(core_pid, signal.SIGKILL)
            except EngineDeadError as exc:
                return exc
            return None

        async def main():
            return await asyncio.gather(talk(0), talk(1)), time.monotonic()

        (errors, ended_at) = asyncio.run(main())
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert ended_at - killed_at[0] < DEATH_NOTICE_S
        assert "killed by signal 9 (SIGKILL)" in str(errors[0])
        for session, deltas in zip(sessions, seen):
            reply = session.history[-1]
            assert reply.status == "error" and "SIGKILL" in reply.error
            assert reply.content == "".join(deltas) and reply.content
        with pytest.raises(EngineDeadError):
            engine.stats()
        with pytest.raises(EngineDeadError):
            engine.generate_text("anyone there?")
        engine.shutdown()  # safe on a dead engine

        with AsyncLLM(str(tiny_model_path), **TINY) as fresh:
            for session in sessions:
                session.engine = fresh
                assert session.send("Are you back?", SamplingParams(max_tokens=8, temperature=0)).status == "complete"
            assert fresh.stats().blocks_used == 0


def test_a_blocking_stream_ends_too(tiny_model_path: Path) -> None:
    engine = AsyncLLM(str(tiny_model_path), **TINY)
    outcome: list[BaseException] = []

    def consume() -> None:
        try:
            for _ in engine.iter_stream("on and on", LONG):
                pass
        except EngineDeadError as exc:
            outcome.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.5)
    engine._core.process.kill()
    consumer.join(timeout=DEATH_NOTICE_S)
    assert not consumer.is_alive() and outcome
    engine.shutdown()


def test_the_core_exits_when_its_front_end_is_killed(tmp_path: Path, tiny_model_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from localpaged.engine.async_llm import AsyncLLM\n"
        "from localpaged.sampling import SamplingParams\n"
        f"engine = AsyncLLM({str(tiny_model_path)!r}, **{TINY!r})\n"
        "print(engine._core.process.pid, flush=True)\n"
        "for out in engine.iter_stream('go on forever', SamplingParams(max_tokens=900, ignore_eos=True)):\n"
        "    if len(out.token_ids) == 5:\n"
        "        print('streaming', flush=True)\n"
    )
    front = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(front.stdout.readline())
        assert front.stdout.readline() == "streaming\n"
        assert alive(core_pid)
        os.kill(front.pid, signal.SIGKILL)
        front.wait(timeout=10)
        deadline = time.monotonic() + DEATH_NOTICE_S
        while alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(core_pid), "the core outlived its front end"
    finally:
        if front.poll() is None:
            front.kill()


def test_start_up_errors_are_the_engines_own() -> None:
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        AsyncLLM("/tmp/does-not-exist/model.gguf")
    with pytest.raises(ConfigError, match="max_num_seqs"):
        AsyncLLM(max_num_seqs=0)  # checked in the front end, before any process starts


def test_the_core_never_imports_a_localpaged_folder_in_the_working_folder(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started from a folder holding a `localpaged` package of its own (a checkout, or anything planted there),
    the core runs the installed code, not that folder's."""
    decoy = tmp_path / "localpaged" / "engine"
    decoy.mkdir(parents=True)
    for init in (decoy.parent / "__init__.py", decoy / "__init__.py"):
        init.write_text("")
    (decoy / "core.py").write_text('raise SystemExit("the working folder\'s localpaged ran")\n')
    monkeypatch.chdir(tmp_path)
    with AsyncLLM(str(tiny_model_path), **TINY) as engine:
        assert engine.generate_text("hi", SamplingParams(max_tokens=2, temperature=0)).finished


def test_a_start_up_error_in_the_core_leaves_no_process(tiny_model_path: Path) -> None:
    children_before = set(_children())
    with pytest.raises(ConfigError, match="max_model_len"):
        AsyncLLM(str(tiny_model_path), **{**TINY, "max_model_len": 10**6})
    time.sleep(0.2)
    assert [pid for pid in _children() if pid not in children_before and alive(pid)] == []


def _children() -> list[int]:
    """This process's child pids."""
    me = os.getpid()
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            kids.append(int(stat.parent.name))
    return kids
