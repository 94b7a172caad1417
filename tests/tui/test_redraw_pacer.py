"""The redraw pace follows the front end's CPU use: slower while it is busy, back to every tick once it is not."""

from localpaged.tui.redraw_pacer import CPU_BUDGET, JUDGE_S, REDRAW_S, SLOWEST_TICKS, RedrawPacer


class Clocks:
    """A wall clock and a CPU clock the test moves: each tick costs `share` of a core."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.share = 0.0

    def advance(self) -> None:
        self.wall += REDRAW_S
        self.cpu += REDRAW_S * self.share


def redraws(pacer: RedrawPacer, clocks: Clocks, seconds: float) -> int:
    """How many of the ticks in ``seconds`` redraw."""
    count = 0
    for _ in range(round(seconds / REDRAW_S)):
        clocks.advance()
        count += pacer.tick()
    return count


def test_an_idle_front_end_redraws_on_every_tick():
    clocks = Clocks()
    pacer = RedrawPacer(lambda: clocks.wall, lambda: clocks.cpu)
    clocks.share = CPU_BUDGET / 4
    assert redraws(pacer, clocks, 5.0) == 50


def test_a_busy_front_end_slows_to_the_slowest_pace_and_recovers():
    clocks = Clocks()
    pacer = RedrawPacer(lambda: clocks.wall, lambda: clocks.cpu)
    clocks.share = CPU_BUDGET * 2
    redraws(pacer, clocks, JUDGE_S * (SLOWEST_TICKS + 1))
    assert pacer.every == SLOWEST_TICKS
    assert redraws(pacer, clocks, 3.0) == round(3.0 / REDRAW_S / SLOWEST_TICKS)
    clocks.share = 0.0
    redraws(pacer, clocks, JUDGE_S * (SLOWEST_TICKS + 1))
    assert pacer.every == 1


def test_between_the_thresholds_the_pace_holds():
    clocks = Clocks()
    pacer = RedrawPacer(lambda: clocks.wall, lambda: clocks.cpu)
    clocks.share = CPU_BUDGET * 2
    redraws(pacer, clocks, JUDGE_S + REDRAW_S)  # judged once, on the last tick
    assert pacer.every == 2
    clocks.share = CPU_BUDGET * 0.75  # under the budget, over half of it
    redraws(pacer, clocks, JUDGE_S * 4)
    assert pacer.every == 2


def test_restart_forgets_the_time_the_timer_was_paused():
    clocks = Clocks()
    pacer = RedrawPacer(lambda: clocks.wall, lambda: clocks.cpu)
    clocks.cpu += 5.0  # busy elsewhere (loading a chat) while no reply grew on screen
    clocks.wall += 10.0
    pacer.restart()
    clocks.share = 0.0
    redraws(pacer, clocks, JUDGE_S * 2)
    assert pacer.every == 1
