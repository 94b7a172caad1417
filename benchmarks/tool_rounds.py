"""Tools: what MCP servers cost the app's first screen, and what the prefix cache serves of replayed tool rounds.

Two measurements, in one run, on the default model:

- ``first_screen_s``: the app (headless, through Textual's Pilot) from start to its chat screen, with no
  MCP server configured and with three (tests/mcp_test_server.py twice, and once with ``--slow 5``: a
  server five seconds slow to start). The servers start in the background, so the goal is a ratio of 1.
  Rounds alternate which goes first; the figures are medians.
- ``replay``: a chat of three turns, each one round of a Python-function tool call (``tool_choice=
  "required"``, so the 135M model's call is grammar-held) and its answer. The third turn's first prompt
  replays the two earlier tool rounds; its prompt tokens and those the prefix cache served are recorded.

Writes benchmarks/results/tool_rounds.json and prints it.

    python benchmarks/tool_rounds.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import MappingProxyType

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SERVER = str(HERE.parent / "tests" / "mcp_test_server.py")
sys.path.insert(0, str(HERE))
from peers import cpu_name

QUESTIONS = ("What is the weather in Paris?", "And in Rome?", "And in Oslo?")


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: the city's name
    """
    return f"18 C and sunny in {city}"


def three_servers() -> dict:
    from localpaged.config_file import McpServerConfig

    return {
        "one": McpServerConfig("one", sys.executable, (SERVER,)),
        "two": McpServerConfig("two", sys.executable, (SERVER,)),
        "slow": McpServerConfig("slow", sys.executable, (SERVER, "--slow", "5")),
    }


async def first_screen(servers: dict) -> float:
    """Seconds from the app's start to its chat screen, the engine loaded for real."""
    from localpaged.config_file import Settings
    from localpaged.tui.app import LocalpagedApp
    from localpaged.tui.screens.main import MainScreen

    app = LocalpagedApp(settings=Settings(mcp_servers=MappingProxyType(servers)), db=":memory:")
    start = time.perf_counter()
    async with app.run_test(size=(120, 40)) as pilot:
        while not any(isinstance(s, MainScreen) for s in app.screen_stack):
            await pilot.pause(0.01)
        elapsed = time.perf_counter() - start
        await pilot.pause(0.5)  # the screen mounted in full before quitting
        await app.action_quit()
    return elapsed


def replay() -> dict:
    from localpaged import LLM
    from localpaged.chat.session import Session
    from localpaged.chat.store import ChatStore
    from localpaged.engine.async_llm import AsyncLLM
    from localpaged.sampling import SamplingParams

    params = SamplingParams(max_tokens=60, temperature=0.0)
    with AsyncLLM(llm=LLM(None)) as engine, ChatStore(":memory:") as store:
        session = Session.new(engine, store)
        turns = []
        for question in QUESTIONS:
            before = len(session.history)
            session.send(question, params, tools=[get_weather], tool_choice="required")
            first = session.history[before + 1]  # the turn's first reply: its call
            turns.append({"prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens})
        rounds = sum(1 for m in session.history if m.role == "tool")
    last = turns[-1]
    return {
        "turns": turns,
        "tool_rounds_replayed": rounds - 1,
        "third_turn_prompt_tokens": last["prompt_tokens"],
        "third_turn_cached_tokens": last["cached_tokens"],
        "third_turn_cached_share": round(last["cached_tokens"] / last["prompt_tokens"], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"none": [], "three servers": []}
    for i in range(args.rounds):
        order = ["none", "three servers"] if i % 2 == 0 else ["three servers", "none"]
        for name in order:
            times[name].append(asyncio.run(first_screen({} if name == "none" else three_servers())))
    medians = {name: round(statistics.median(values), 3) for name, values in times.items()}
    data = {
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": __import__("torch").get_num_threads()},
        "date": time.strftime("%Y-%m-%d"),
        "model": "SmolLM2-135M-Instruct",
        "first_screen_s": medians,
        "first_screen_ratio": round(medians["three servers"] / medians["none"], 3),
        "rounds": args.rounds,
        "replay": replay(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tool_rounds.json").write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
