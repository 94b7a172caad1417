"""The docs hold no figure of their own: docs/benchmarks.md and the README's results table are what
tools/benchmarks_doc.py writes from benchmarks/results/ now, and every relative link resolves."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "README.md"]


def _generator():
    spec = importlib.util.spec_from_file_location("benchmarks_doc", ROOT / "tools" / "benchmarks_doc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_benchmarks_doc_is_what_the_results_give() -> None:
    assert (ROOT / "docs" / "benchmarks.md").read_text() == gen.render_doc(), (
        "docs/benchmarks.md differs from benchmarks/results/: run `make docs`"
    )


def test_readme_results_table_is_what_the_results_give() -> None:
    readme = (ROOT / "README.md").read_text()
    assert gen.BEGIN in readme and gen.END in readme
    assert readme == gen.readme_with_block(readme, gen.render_readme_block()), (
        "README.md's results tables differ from benchmarks/results/peers.json and shapes.json: run `make docs`"
    )


def test_an_unknown_or_broken_results_file_gets_a_section_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "ttft_sweep.json").write_text(
        json.dumps({"date": "2027-01-01", "rows": [{"clients": 4, "tok_s": 100.5}], "ttfts": [0.1, 0.2, 0.3]})
    )
    (tmp_path / "ttft_sweep_ttft.png").write_bytes(b"")
    (tmp_path / "truncated.json").write_text('{"tok_s": ')
    (tmp_path / "kv_disk.json").write_text(json.dumps([1, 2]))  # a known name in a shape its renderer never saw
    doc = gen.render_doc(tmp_path)
    assert "## ttft_sweep" in doc
    assert "| rows / 0 / tok_s | 100.5 |" in doc
    assert "| ttfts | 0.2 (median of 3) |" in doc
    assert "date: 2027-01-01" in doc
    assert "![ttft_sweep_ttft.png](../benchmarks/results/ttft_sweep_ttft.png)" in doc
    assert "could not be read (JSONDecodeError)" in doc
    assert "## The disk KV tier" in doc


def test_a_shared_prompt_model_run_is_labelled_by_its_own_figures(tmp_path: Path) -> None:
    seed = json.loads((ROOT / "benchmarks" / "results" / "shared_prompt-smollm2-135m-32k.json").read_text())
    (tmp_path / "shared_prompt-seed.json").write_text(json.dumps(seed))
    smaller = seed | {"shared_tokens": 12000, "rounds": 2}
    smaller["points"] = [p | {"users": 50} for p in seed["points"]]
    (tmp_path / "shared_prompt-smaller.json").write_text(json.dumps(smaller))
    doc = gen.render_doc(tmp_path)
    seed_part, smaller_part = doc.split("## One long system prompt, many users: smaller")
    assert "--users 200 --shared-tokens 30000 --new-tokens 16 --rounds 1`" in seed_part
    assert "(the goal: within 180 s)" in seed_part
    assert "--users 50 --shared-tokens 12000 --new-tokens 16 --rounds 2`" in smaller_part
    assert "the goal" not in smaller_part


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", re.sub(r"```.*?```", "", markdown, flags=re.DOTALL), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower().replace("`", "")).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_something_there(doc: Path) -> None:
    text = doc.read_text()
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.DOTALL)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what is not there: {broken}"
