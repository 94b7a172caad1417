"""The status line's speculative-decoding figure: the share of draft tokens kept, shown once there is one."""

from __future__ import annotations

import pytest
from pilot_helpers import main_screen, wait_for

from localpaged.tui.widgets.status_line import StatusLine

pytestmark = pytest.mark.anyio


def status_text(screen) -> str:
    return str(screen.query_one(StatusLine).render())


@pytest.mark.parametrize(("drafts", "shown"), [(None, None), ((0, 0), None), ((200, 124), "drafts kept 62%")])
async def test_the_share_of_drafts_kept_shows_once_drafts_were_checked(make_app, engine, drafts, shown) -> None:
    engine.drafts = drafts
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await main_screen(pilot)
        screen.refresh_figures()
        await wait_for(pilot, lambda: "prefix cache hits" in status_text(screen))
        if shown is None:
            assert "drafts" not in status_text(screen)
        else:
            assert shown in status_text(screen)
