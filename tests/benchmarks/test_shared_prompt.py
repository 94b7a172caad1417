"""benchmarks/shared_prompt.py on a tiny model: the KV accounting and the JSON it writes, not its timings."""

from __future__ import annotations

import json

import shared_prompt

TIMED = ("first_prefill_s", "ttft_last_s", "ttft_median_s", "decode_tok_s", "decode_step_ms")


def test_shared_prompt_holds_the_pool_between_the_minimum_and_no_sharing(tiny_gguf, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shared_prompt, "llama_bin_dir", lambda: None)  # never a llama-server here
    out = tmp_path / "shared.json"
    # A system prompt longer than one step's 512 tokens: the later users find its first chunk cached.
    argv = ["--model", str(tiny_gguf), "--users", "1,3", "--shared-tokens", "700", "--new-tokens", "3"]
    shared_prompt.main([*argv, "--rounds", "2", "--out", str(out)])
    results = json.loads(out.read_text())

    assert results["llama_kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2  # layers, K and V, kv heads, head dim, f16
    assert [p["users"] for p in results["points"]] == [1, 3]
    assert set(results["step_ratio"]) == {"users", "on", "off"}
    for point in results["points"]:
        assert point["shared_prefix_tokens"] > 700
        assert point["llama_kvu_tokens"] <= point["llama_np_tokens"]
        assert set(point["on_over_off"]) >= set(TIMED)
        for name in ("on", "off"):
            assert len(point["runs"][name]) == 2
            for run in point["runs"][name]:
                assert run["minimum_blocks"] <= run["peak_blocks"] <= run["unshared_blocks"]
                assert run["unshared_blocks"] <= run["unshared_whole_blocks"]
                assert run["minimum_blocks"] <= run["minimum_whole_blocks"] <= run["unshared_whole_blocks"]
                assert run["first_prefill_s"] <= run["ttft_median_s"] <= run["ttft_last_s"]
                assert run["decode_steps"] >= 1 and 1 <= run["decode_batch"] <= point["users"]
            m = point[name]
            assert all(m[key] > 0 for key in TIMED)
            assert m["peak_bytes"] == m["peak_blocks"] * results["block_bytes"]
            assert m["minimum_bytes"] <= m["peak_bytes"] <= m["unshared_bytes"]
            if point["users"] == 1:  # nothing to share: the pool holds exactly the one context
                assert m["minimum_blocks"] == m["peak_blocks"] == m["unshared_blocks"]
            else:
                assert m["peak_blocks"] < m["unshared_blocks"]
