"""benchmarks/spec_decode.py --quick on a tiny model, off, "suffix" and the model as its own draft: every row and the
file it writes, not its timings."""

from __future__ import annotations

import json

import spec_decode

ROWS = {"code_edit", "regenerate", "continue", "chat", "sessions_4"}


def test_spec_decode_quick_writes_every_row(tiny_gguf, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(spec_decode, "llama_bin_dir", lambda: None)  # never a llama-server here
    out = tmp_path / "spec_decode.json"
    args = ["--quick", "--modes", "suffix", "--model", str(tiny_gguf), "--draft", str(tiny_gguf), "--out", str(out)]
    spec_decode.main(args)
    results = json.loads(out.read_text())

    assert results["quick"] and results["rounds"] == 1 and results["modes"] == ["suffix", "draft"]
    assert results["draft"] == {"draft": str(tiny_gguf), "k": 3}
    assert set(results["rows"]) == ROWS
    for name, row in results["rows"].items():
        assert row["off"]["tok_s"] > 0 and row["off"]["identical"], name
        assert row["goal"] == spec_decode.GOALS[name.split("_")[0] if name.startswith("sessions") else name]
        if "suffix" in row:
            assert row["suffix"]["identical"], name  # greedy: the same tokens with drafts
        assert row["draft"]["identical"], name
        assert row["draft"]["accepted"] == row["draft"]["proposed"], name  # the model drafting for itself
    # A fresh engine's draft model drafts before its cost is weighed (itself as its draft never pays, and then
    # rests: the regenerate and continue on the same engine may draft nothing)
    assert results["rows"]["code_edit"]["draft"]["accepted"] > 0
    assert results["rows"]["regenerate"]["suffix"]["accepted"] > 0  # the first reply drafts the second
    assert results["rows"]["sessions_4"]["prompts"] == 4
    assert results["rows"]["regenerate"]["off"]["same_as_first_reply"]  # greedy: a regenerate is the same reply
    assert results["llama_server"]["available"] is False
    assert "make bench-peers" in results["llama_server"]["note"]
    assert {"cpu", "cpus", "threads"} <= set(results["machine"]) and results["date"]
