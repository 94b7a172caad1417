"""The KV map panel folds its grid for the width it has once laid out."""

from __future__ import annotations

import pytest
from pilot_helpers import main_screen, wait_for

from localpaged.tui.widgets.kv_map import KVMapPanel

pytestmark = pytest.mark.anyio


async def test_figures_that_arrive_before_the_panel_is_laid_out_are_refolded_for_its_width(make_app, engine):
    """Showing the panel asks for figures on a thread; they can arrive before the panel has a width, and the grid
    was then folded into 8 columns (the floor for no width) until the next refresh."""
    async with make_app().run_test(size=(120, 40)) as pilot:
        screen = await main_screen(pilot)
        screen.stop_refreshing()  # no periodic redraw to mend the grid instead
        panel = screen.query_one(KVMapPanel)
        assert not panel.display and panel.content_size.width == 0
        panel.show(engine.kv_map(), engine.stats())  # the figures, before the panel is on screen
        panel.display = True
        grid = panel.query_one("#kv-grid")
        await wait_for(pilot, lambda: panel.content_size.width > 8)
        await wait_for(pilot, lambda: len(str(grid.content).split("\n")[0]) == panel.content_size.width)
