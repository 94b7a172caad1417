"""benchmarks/sampling_cost.py on a tiny model: every scenario timed through the sampler the engine calls."""

from __future__ import annotations

import json

import sampling_cost


def test_sampling_cost_times_every_scenario(tiny_gguf, tmp_path) -> None:
    out = tmp_path / "sampling_cost.json"
    data = sampling_cost.main(["--quick", "--model", str(tiny_gguf), "--out", str(out)])
    assert json.loads(out.read_text()) == data
    assert set(data["scenarios"]) == set(sampling_cost.SCENARIOS)
    for row in data["scenarios"].values():
        assert row["sampler_ms"] > 0 and row["step_ms"] > row["sampler_ms"] and row["steps"] > 0
    assert data["ratios"]["none"] == {"sampler": 1.0, "step": 1.0}
