"""How often the open chat's growing reply is redrawn: up to 10 times a second, less while the front end is busy.

Every redraw re-lays out the screen and renders its visible lines again (the reply scrolls), and on
a machine of few cores that CPU is taken from the engine core, whose threads then wait for each other
at every barrier. On one chat, 30 redraws a second streamed visibly slower than 10, and 10 nearly as
fast as none; a reply taller than the screen (every redraw scrolls) costs more again
(benchmarks/app_speed.py measures the app against the engine on a plain script, with the front
end's CPU share).

So the pace follows the front end's own CPU use (all its threads: drawing, the store's writes, the
channel to the core), judged once a second: above CPU_BUDGET of one core the reply is redrawn on
every second tick, then every third; below half of it, on every tick again. Short replies keep 10
redraws a second; a long reply, or many chats streaming, drops to 3-5.
"""

from __future__ import annotations

import time
from collections.abc import Callable

REDRAW_S = 1 / 10  # the tick: the fastest pace
SLOWEST_TICKS = 3  # at most every third tick: 3.3 redraws a second
CPU_BUDGET = 0.08  # of one core, for the whole front end
JUDGE_S = 1.0  # how often the pace is re-judged


class RedrawPacer:
    """Says at each tick whether to redraw; ``restart`` when a reply starts growing on screen."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, cpu_clock: Callable[[], float] = time.process_time
    ) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self.every = 1  # redraw on every `every`-th tick
        self.restart()

    def restart(self) -> None:
        """Start a new judging window (the timer was paused: the time since says nothing)."""
        self._window_wall, self._window_cpu = self._clock(), self._cpu_clock()
        self._ticks = 0

    def tick(self) -> bool:
        """Called every REDRAW_S while a shown reply grows: True when this tick should redraw."""
        now = self._clock()
        if now - self._window_wall >= JUDGE_S:
            cpu = self._cpu_clock()
            share = (cpu - self._window_cpu) / (now - self._window_wall)
            if share > CPU_BUDGET:
                self.every = min(self.every + 1, SLOWEST_TICKS)
            elif share < CPU_BUDGET / 2:
                self.every = max(self.every - 1, 1)
            self._window_wall, self._window_cpu = now, cpu
        self._ticks += 1
        return self._ticks % self.every == 0
