"""benchmarks/spec_step_cost.py on a tiny model: a time for every batch and draft count, not what they are."""

from __future__ import annotations

import spec_step_cost


def test_spec_step_cost_times_every_batch_and_draft_count(tiny_gguf) -> None:
    table = spec_step_cost.main(["--model", str(tiny_gguf), "--batches", "1,2", "--drafts", "1,3", "--steps", "3"])
    assert set(table) == {1, 2}
    for row in table.values():
        assert set(row) == {0, 1, 3} and all(t > 0 for t in row.values())


def test_spec_step_cost_with_a_draft_model(tiny_gguf) -> None:
    """The tiny model drafting for itself: every step runs its k draft slots through the draft model."""
    args = ["--model", str(tiny_gguf), "--draft", str(tiny_gguf), "--batches", "2", "--drafts", "2", "--steps", "3"]
    table = spec_step_cost.main(args)
    assert set(table) == {2} and set(table[2]) == {0, 2} and all(t > 0 for t in table[2].values())
