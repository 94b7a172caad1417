"""The disk KV tier across restarts, with the real default model in engine core processes.

One cold process fills the tier; a second, fresh process answers the same chats from it, token
for token; a third answers them again after half the files were deleted and others damaged.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from localpaged import AsyncLLM, SamplingParams
from localpaged.engine.kv_disk import BlockLayout, encode_header
from tests.conftest import DEFAULT_MODEL, DEVICE

pytestmark = pytest.mark.model

BS = 16
SYSTEM = (
    "You are a careful assistant for a small team of gardeners. Answer in one short sentence, name the plant, "
    "and prefer plain words. The team grows tomatoes, beans, squash, herbs and a few apple trees on clay soil "
    "in a windy, dry place with cold nights in spring. They water by hand in the morning and keep no chemicals."
)
QUESTIONS = ("When should we sow beans?", "Which herb likes shade?")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ENGINE = {"dtype": "float32", "device": DEVICE, "kv_cache_memory": "256MiB", "max_model_len": 1024}


def chats(engine: AsyncLLM, turn1: str | None = None) -> tuple[dict[str, list[int]], dict[str, int], str]:
    """Two chats sharing a system prompt, then a chat's second turn: each reply's tokens, each prompt's
    disk tokens (and the full blocks of the shared prompts), and the first turn's reply.

    ``turn1``: the first turn's reply as stored, to send the second turn straight away as a reopened
    chat does after a restart; None runs the first turn here first.
    """
    system = [{"role": "system", "content": SYSTEM}]
    replies: dict[str, list[int]] = {}
    disk: dict[str, int] = {}
    first = system + [{"role": "user", "content": "Name a fruit tree."}]
    if turn1 is None:
        turn1 = engine.generate_text(first, GREEDY).text
    asked = [(q, system + [{"role": "user", "content": q}]) for q in QUESTIONS]
    asked.append(("turn 2", first + [{"role": "assistant", "content": turn1}, {"role": "user", "content": "Another?"}]))
    for name, messages in asked:
        out = engine.generate_text(messages, GREEDY)
        replies[name], disk[name] = out.token_ids, out.metrics.disk_tokens
        assert out.metrics.disk_tokens <= out.metrics.cached_tokens
    disk["turn 1 prompt"] = len(engine.encode_chat(first)) // BS * BS
    disk["system"] = len(engine.encode_chat(system)) // BS * BS
    return replies, disk, turn1


def damage(folder: Path, foreign: Path) -> int:
    """Delete half the block files and damage four of the rest; the number of files damaged."""
    files = sorted(folder.glob("*.kvb"))
    random.Random(0).shuffle(files)
    for f in files[: len(files) // 2]:
        f.unlink()
    flipped, truncated, refingered, other_model = files[len(files) // 2 :][:4]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x55
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    raw = refingered.read_bytes()
    payload = memoryview(raw[16 + int.from_bytes(raw[12:16], "little") :])  # after magic, version, header
    layout = BlockLayout("0" * 64, (2, 30, 16, 3, 64), "float32", payload.nbytes)
    refingered.write_bytes(encode_header(layout, bytes.fromhex(refingered.name[:64]), payload) + bytes(payload))
    shutil.copyfile(foreign, other_model)
    return 4


def test_restarted_engines_read_the_tier_and_answer_as_a_cold_engine(kv_disk, tiny_llm, capfd):
    with AsyncLLM(DEFAULT_MODEL, **ENGINE) as engine:
        cold, disk, turn1 = chats(engine)
    assert not any(disk[name] for name in (*QUESTIONS, "turn 2"))  # an empty tier: nothing came from disk
    (folder,) = [p for p in kv_disk.iterdir() if p.is_dir()]

    with AsyncLLM(DEFAULT_MODEL, **ENGINE) as engine:  # a fresh process on the same tier
        warm, disk, _ = chats(engine, turn1)  # turn 2 of a stored chat, reopened
        stats = engine.stats()
    assert warm == cold
    assert disk[QUESTIONS[0]] >= disk["system"] > 0  # the shared prompt's full blocks came from disk
    # The stored chat's first turn came from disk too (its system prompt was read, and counted, before).
    assert disk["turn 2"] >= disk["turn 1 prompt"] - disk["system"] > 0
    assert stats.disk_tokens == sum(disk[name] for name in (*QUESTIONS, "turn 2"))

    # A block file of another model, to be found where one of ours should be.
    tiny = tiny_llm()
    tiny.generate([list(range(100, 140))], GREEDY)
    tiny.close()
    foreign = next(tiny.kv_disk.folder.glob("*.kvb"))
    damage(folder, foreign)
    capfd.readouterr()
    with AsyncLLM(DEFAULT_MODEL, **ENGINE) as engine:
        again, _, _ = chats(engine, turn1)
    assert again == cold
    assert capfd.readouterr().err.count("corrupt, truncated or foreign") <= 1  # a warning at most once
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in folder.glob("*.kvb"))
