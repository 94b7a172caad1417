"""Does the app stream at the engine's speed? Ratios against ``LLM.chat`` on a plain script's main thread.

Every contender runs in a fresh interpreter, one after another in this one run (these machines
drift by +-20% from minute to minute, so only figures from the same run are compared):

- ``script``: ``LLM.chat`` on the main thread of a plain script: the engine's own speed (baseline).
- ``process`` / ``thread``: one chat through ``AsyncLLM.iter_stream``, the core in its own process
  (the default) or on a thread of the caller's process (how it was before), rated where the tokens
  arrive; ``+ui`` adds a UI-like thread to the front end (5 ms of pure-Python work every 33 ms,
  i.e. redrawing at 30 fps).
- ``app``: the real Textual app, headless, one chat and then 8 chats streaming at once, in both
  modes; the 8 against ``LLM.generate`` of the same 8 conversations on a plain script. Then the
  same with the app's real driver drawing to a terminal: a pty whose output is read and dropped
  (what the app's own drawing costs) and a tmux session (a terminal emulator on the same cores, as
  when a user runs ``localpaged chat`` here). The front end's CPU share is reported for each.
- start-up: ``localpaged run "hi" --max-tokens 1`` from command start to exit, and the app from
  start to the loading screen closing, in both modes.

Replies are greedy and run to exactly ``--tokens`` tokens (EOS ignored), so every contender does the
same work. Every contender runs ``--repeat`` times, round by round, and each figure is its best:
these machines drift by +-20%, and the best of each is the least disturbed. Results go to
benchmarks/results/app_speed.json.

    python benchmarks/app_speed.py [--tokens 128] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import pty
import shlex
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

from kv_folder import own_kv_folder

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "app_speed.json"
SYSTEM = "You are a helpful assistant."
QUESTIONS = [
    "Write a short poem about rivers.",
    "Explain what a hash table is.",
    "Give me three tips for sleeping well.",
    "Describe the water cycle.",
    "What is a prime number?",
    "Tell me a story about a cat.",
    "How do airplanes fly?",
    "Why is the sky blue?",
]
UI_WORK_S, UI_PERIOD_S = 0.005, 1 / 30
TERMINAL_SIZE = (120, 40)  # columns, rows: the headless app's size too


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def params(tokens: int):
    from localpaged import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


# ----- contenders (each runs in its own interpreter) ------------------------------------------


def ui_like_thread(stop: threading.Event) -> threading.Thread:
    """5 ms of pure-Python work every 33 ms: what a terminal UI redrawing at 30 fps costs."""

    def work() -> None:
        while not stop.is_set():
            end = time.perf_counter() + UI_WORK_S
            while time.perf_counter() < end:
                sum(i * i for i in range(200))
            stop.wait(UI_PERIOD_S - UI_WORK_S)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def run_script(args: argparse.Namespace) -> dict:
    from localpaged import LLM

    llm = LLM(args.model)
    llm.chat(conversation("warm up"), params(8))
    out = llm.chat(conversation(QUESTIONS[0]), params(args.tokens))[0]
    start = time.perf_counter()
    many = llm.chat([conversation(q) for q in QUESTIONS], params(args.tokens))
    wall = time.perf_counter() - start
    llm.close()  # the disk tier's last writes, before own_kv_folder removes its folder
    return {
        "tok_s": out.metrics.decode_tokens_per_s,
        "eight_tok_s": sum(o.metrics.generated_tokens for o in many) / wall,
        "eight_each_tok_s": sum(o.metrics.decode_tokens_per_s for o in many) / len(many),
    }


def run_stream(args: argparse.Namespace, process: bool, ui: bool) -> dict:
    from localpaged import AsyncLLM

    engine = AsyncLLM(args.model, engine_process=process)
    stop = threading.Event()
    if ui:
        ui_like_thread(stop)
    try:
        engine.generate_text(conversation("warm up"), params(8))
        arrivals = [time.perf_counter() for _ in engine.iter_stream(conversation(QUESTIONS[0]), params(args.tokens))]
    finally:
        stop.set()
        engine.shutdown()
    return {"tok_s": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])}


def run_app(args: argparse.Namespace, process: bool) -> dict:
    """The app headless (Textual's test driver: it draws nothing to a terminal)."""
    from localpaged.chat.store import ChatStore
    from localpaged.engine.async_llm import AsyncLLM
    from localpaged.tui.app import LocalpagedApp

    started = time.perf_counter()

    async def main() -> dict:
        with tempfile.TemporaryDirectory() as folder, ChatStore(Path(folder) / "chats.db") as store:
            app = LocalpagedApp(lambda progress: AsyncLLM(args.model, engine_process=process, progress=progress), store)
            async with app.run_test(headless=True, size=TERMINAL_SIZE) as pilot:
                return await drive_app(pilot, store, args.tokens, started)

    return asyncio.run(main())


def run_app_on_terminal(args: argparse.Namespace) -> dict:
    """The app with its real driver, on whatever terminal this process was started on (see ``measure``)."""
    from localpaged.chat.store import ChatStore
    from localpaged.engine.async_llm import AsyncLLM
    from localpaged.tui.app import LocalpagedApp

    started = time.perf_counter()
    results: dict = {}
    with tempfile.TemporaryDirectory() as folder, ChatStore(Path(folder) / "chats.db") as store:
        app = LocalpagedApp(lambda progress: AsyncLLM(args.model, progress=progress), store)

        async def auto_pilot(pilot) -> None:
            results.update(await drive_app(pilot, store, args.tokens, started))

        app.run(auto_pilot=auto_pilot)
    return results


async def drive_app(pilot, store, tokens: int, started: float) -> dict:
    """Wait for the chat screen, then one chat (after a warm-up reply) and 8 chats at once; quits the app."""
    from localpaged.tui.screens.main import MainScreen

    app = pilot.app
    while not (isinstance(app.screen, MainScreen) and app.screen.query("#chat-title")):
        await asyncio.sleep(0.01)  # until the chat screen is there and composed
    results = {"start_to_chat_s": time.perf_counter() - started}
    screen = app.screen
    await replies(screen, [QUESTIONS[0]], store, tokens)  # warm-up: first prefill, first draw
    results["one_chat"] = await replies(screen, [QUESTIONS[0]], store, tokens)
    results["eight_chats"] = await replies(screen, QUESTIONS, store, tokens)
    await app.action_quit()
    return results


async def replies(screen, questions: list[str], store, tokens: int) -> dict:
    """One new chat per question, the first on screen; start every reply at once, as fast as the app can.

    Returns the front end's CPU time over the wall time (all its threads: the app, the store's writes,
    the channel to the core), each reply's decode tok/s as the engine timed it (first token to last, as LLM.chat's
    metrics do: what the status line shows once a reply is done), the status line's live figure
    while it generated (text chunks a second: tokens that add no text, such as end-of-turn tokens
    past ignore_eos, are not counted there), and the aggregate: generated tokens over the wall time
    from the first start to the last end.
    """
    from localpaged.chat.session import Session

    chats = [screen.adopt(Session.new(screen.engine, store, system=SYSTEM)) for _ in questions]
    for chat in chats:  # every reply greedy and exactly `tokens` long, whatever the settings say
        chat.session.sampling, chat.session.max_tokens = params(tokens), tokens
    await screen.open(chats[0].session.id)  # one chat on screen, the others streaming behind it
    began, cpu_began = time.perf_counter(), time.process_time()
    for chat, question in zip(chats, questions):
        await screen.start_reply(chat, question)
    shown: dict = {}  # the status line's live figure of each chat, as last seen while it generated
    while any(chat.generating for chat in chats):
        for chat in chats:
            if chat.generating and chat.figures().tokens_per_s:
                shown[chat] = chat.figures().tokens_per_s
        await asyncio.sleep(0.05)  # not pilot.pause, which forces screen updates a real app would not make
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    metrics = [chat.session.last_metrics for chat in chats]
    return {
        "front_end_cpu_share": cpu / wall,
        "decode_tok_s": [m.decode_tokens_per_s for m in metrics],
        "status_line_tok_s": [shown.get(chat, 0.0) for chat in chats],
        "aggregate_tok_s": sum(m.generated_tokens for m in metrics) / wall,
    }


def run_cli_startup(args: argparse.Namespace, process: bool) -> dict:
    env = dict(os.environ, LOCALPAGED_ENGINE_PROCESS="1" if process else "0")
    command = [sys.executable, "-m", "localpaged.cli", "run", "hi", "--max-tokens", "1", "--no-store"]
    if args.model:
        command += ["--model", args.model]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return {"seconds": time.perf_counter() - start}


CONTENDERS = {
    "script": run_script,
    "process": lambda a: run_stream(a, process=True, ui=False),
    "process+ui": lambda a: run_stream(a, process=True, ui=True),
    "thread": lambda a: run_stream(a, process=False, ui=False),
    "thread+ui": lambda a: run_stream(a, process=False, ui=True),
    "app/process": lambda a: run_app(a, process=True),
    "app/thread": lambda a: run_app(a, process=False),
    "app/pty": run_app_on_terminal,
    "app/tmux": run_app_on_terminal,
    "run/process": lambda a: run_cli_startup(a, process=True),
    "run/thread": lambda a: run_cli_startup(a, process=False),
}


# ----- the run ------------------------------------------------------------------------------------


def measure(name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--contender", name, "--tokens", str(args.tokens)]
    if args.model:
        command += ["--model", args.model]
    if name in ("app/pty", "app/tmux"):
        return measure_on_terminal(name, command)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_on_terminal(name: str, command: list[str]) -> dict:
    """Run the app contender on a terminal, its figures coming back through a file (its stdout is the screen).

    ``app/pty``: a pseudo-terminal of TERMINAL_SIZE whose output this process reads and throws away, as
    fast as it comes: what the app itself costs to draw (Textual's rendering and the bytes it writes),
    counted in bytes a second. ``app/tmux``: a detached tmux session of the same size, so a real
    terminal emulator (tmux's server parses and keeps the screen) shares the 2 cores, as it does when
    a user runs ``localpaged chat`` here.
    """
    columns, rows = TERMINAL_SIZE
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        command = [*command, "--out", str(out)]
        env = dict(os.environ, TERM="xterm-256color", COLORTERM="truecolor")
        if name == "app/tmux":
            session = f"app-speed-{os.getpid()}"
            subprocess.run(
                ["tmux", "new-session", "-d", "-s", session, "-x", str(columns), "-y", str(rows), shlex.join(command)],
                env=env,
                check=True,
            )
            try:
                while (
                    subprocess.run(["tmux", "has-session", "-t", session], check=False, capture_output=True).returncode
                    == 0
                ):
                    time.sleep(0.2)
            finally:
                subprocess.run(["tmux", "kill-session", "-t", session], check=False, capture_output=True)
            written = None
        else:
            main_fd, terminal_fd = pty.openpty()
            fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
            child = subprocess.Popen(
                command, stdin=terminal_fd, stdout=terminal_fd, stderr=terminal_fd, env=env, start_new_session=True
            )
            os.close(terminal_fd)
            written = 0
            while True:
                try:
                    chunk = os.read(main_fd, 1 << 16)
                except OSError:  # EIO: the terminal's last user has gone
                    break
                if not chunk:
                    break
                written += len(chunk)
            child.wait()
            os.close(main_fd)
        if not out.exists():
            raise SystemExit(f"{name} failed: no figures came back (run it by hand: {shlex.join(command)})")
        figures = json.loads(out.read_text())
    if written is not None:
        figures["terminal_bytes"] = written
    return figures


LOWER_IS_BETTER = ("seconds", "start_to_chat_s", "front_end_cpu_share")


def best(kept: dict | None, new: dict) -> dict:
    """Figure by figure, the better of two rounds: the highest rate, the shortest start-up."""
    if kept is None:
        return new
    merged = {}
    for key, value in new.items():
        old = kept[key]
        if isinstance(value, dict):
            merged[key] = best(old, value)
        elif isinstance(value, list):
            merged[key] = [max(a, b) for a, b in zip(old, value)]
        else:
            merged[key] = min(old, value) if key in LOWER_IS_BETTER else max(old, value)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="a local HF folder or .gguf (default: the default model)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds; each figure is the best of them")
    parser.add_argument("--contender", choices=sorted(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)  # where a contender on a terminal writes
    args = parser.parse_args()
    if args.contender:
        figures = json.dumps(CONTENDERS[args.contender](args))
        if args.out:
            args.out.write_text(figures)
        else:
            print(figures)
        return

    results: dict = {}
    for _ in range(args.repeat):  # rounds of every contender in turn, so drift hits them alike
        for name in CONTENDERS:
            results[name] = best(results.get(name), measure(name, args))
    base = results["script"]["tok_s"]
    print(f"one chat, {args.tokens} greedy tokens, decode tok/s where the tokens arrive (2 cores)")
    print(f"{'path':<52}{'tok/s':>8}{'ratio':>8}")
    rows = [
        ("LLM.chat, main thread of a plain script (baseline)", base),
        ("AsyncLLM, core in its own process", results["process"]["tok_s"]),
        ("AsyncLLM, core process, UI-like thread in front end", results["process+ui"]["tok_s"]),
        ("AsyncLLM, core on a thread (before)", results["thread"]["tok_s"]),
        ("AsyncLLM, core on a thread, UI-like thread (before)", results["thread+ui"]["tok_s"]),
        ("app (headless), one chat, core process", results["app/process"]["one_chat"]["decode_tok_s"][0]),
        ("app (headless), one chat, core thread (before)", results["app/thread"]["one_chat"]["decode_tok_s"][0]),
        ("app on a pty (output read and dropped), one chat", results["app/pty"]["one_chat"]["decode_tok_s"][0]),
        ("app in tmux, one chat", results["app/tmux"]["one_chat"]["decode_tok_s"][0]),
    ]
    for label, rate in rows:
        print(f"{label:<52}{rate:>8.1f}{rate / base:>7.2f}x")
    eight_base = results["script"]["eight_tok_s"]
    print(f"\n8 chats at once, tokens / wall time, against LLM.chat of the same 8 on a plain script: {eight_base:.1f}")
    each_base = results["script"]["eight_each_tok_s"]
    print(f"  each of the 8 decodes there at {each_base:.1f} tok/s; after each chat list, the app's mean against it")
    apps = {
        "app/process": "headless, core process",
        "app/thread": "headless, core thread (before)",
        "app/pty": "on a pty, core process",
        "app/tmux": "in tmux, core process",
    }
    for name, label in apps.items():
        eight = results[name]["eight_chats"]
        per = ", ".join(f"{r:.1f}" for r in eight["decode_tok_s"])
        aggregate, mean = eight["aggregate_tok_s"], sum(eight["decode_tok_s"]) / len(eight["decode_tok_s"])
        print(
            f"  app, {label:<31}{aggregate:>8.1f}{aggregate / eight_base:>7.2f}x   each chat: {per}  {mean / each_base:.2f}x"
        )
    print("\nthe front end's CPU (all its threads) while replies streamed, share of one core: one chat / 8 chats")
    for name, label in apps.items():
        one, eight = results[name]["one_chat"], results[name]["eight_chats"]
        print(f"  app, {label:<31}{one['front_end_cpu_share']:>7.1%} / {eight['front_end_cpu_share']:.1%}")
    print(f"  written to the pty: {results['app/pty']['terminal_bytes'] / 1e3:.0f} kB in all")
    print("\nstart-up, seconds")
    for mode in ("process", "thread"):
        label = "core process" if mode == "process" else "core thread (before)"
        print(
            f"  {label:<22} localpaged run 'hi' --max-tokens 1: {results[f'run/{mode}']['seconds']:.2f}   "
            f"app start to chat screen: {results[f'app/{mode}']['start_to_chat_s']:.2f}"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"tokens": args.tokens, "results": results}, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(HERE.parent)}")


if __name__ == "__main__":
    with own_kv_folder():  # cold means cold: no blocks from earlier runs
        main()
