"""benchmarks/spec_step_cost.py on a tiny model: a time for every batch and draft count, not what they are."""

from __future__ import annotations

import spec_step_cost


def test_spec_step_cost_times_every_batch_and_draft_count(tiny_gguf) -> None:
    table = spec_step_cost.main(["--model", str(tiny_gguf), "--batches", "1,2", "--drafts", "1,3", "--steps", "3"])
    assert set(table) == {1, 2}
    for row in table.values():
        assert set(row) == {0, 1, 3} and all(t > 0 for t in row.values())
