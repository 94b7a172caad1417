"""Packed weights copied onto huge pages in the background and swapped in between steps: the same weights, the same
tokens, nothing moved where Linux gives no huge pages or memory cannot hold the copy."""

from __future__ import annotations

import pytest
import torch

from localpaged import SamplingParams
from localpaged.engine import setup
from localpaged.kernels import cpu
from localpaged.layers.linear import BlockLinear
from localpaged.models import huge_pages
from localpaged.models.huge_pages import HUGE_PAGE, HugePageMove, onto_huge_pages
from tests.gguf_models import NATIVE_TYPES, tiny_hf_model, write_gguf
from tests.kernels.test_cpu_kernels import Q4_1, Q6_K, Q8_0, pack, random_blocks

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="the native CPU kernels are not built here")
NEEDS_HUGE_PAGES = pytest.mark.skipif(
    not huge_pages.huge_pages_available(), reason="this kernel gives no transparent huge pages"
)


@NEEDS_HUGE_PAGES
def test_the_copies_are_the_same_weights_in_one_mapping_from_a_huge_page_boundary():
    gen = torch.Generator().manual_seed(0)
    packs = [
        pack(random_blocks(rows, cols, q, gen, group))
        for rows, cols, q, group in ((48, 512, Q4_1, 32), (32, 256, Q6_K, 16), (16, 96, Q8_0, 32))
    ]
    copies = onto_huge_pages(packs)
    x = torch.randn(3, 512, generator=gen)
    for original, copy in zip(packs, copies):
        for name in cpu.PACKED_TENSORS:
            a, b = getattr(original, name), getattr(copy, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
        assert torch.equal(cpu.qgemm(x[:, : original.cols], original), cpu.qgemm(x[:, : copy.cols], copy))
    first = copies[0].q.data_ptr()
    assert first % HUGE_PAGE == 0
    last = copies[-1]
    end = max(t.data_ptr() + t.nbytes for t in (last.q, last.unit, last.mult))
    assert end - first <= huge_pages.packed_bytes(packs)


def test_a_projection_moves_only_to_its_own_weight():
    gen = torch.Generator().manual_seed(1)
    weight = random_blocks(32, 256, Q4_1, gen)
    linear = BlockLinear(pack(weight), None)
    with pytest.raises(ValueError, match="not another weight"):
        linear.move_to(pack(random_blocks(48, 256, Q4_1, gen)))
    same = pack(weight)
    linear.move_to(same)
    assert linear.packed is same and linear.q is same.q


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gguf_tokenizer):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return write_gguf(path, tiny_hf_model("llama"), "llama", NATIVE_TYPES, gguf_tokenizer)


def _greedy(llm) -> list[int]:
    out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    return out[0].token_ids


@NEEDS_HUGE_PAGES
def test_an_engine_swaps_its_weights_in_between_steps_and_decodes_the_same(tiny, monkeypatch):
    from localpaged import LLM

    monkeypatch.setattr(setup, "available_memory", lambda: 1 << 40)  # whatever the machine has free now
    llm = LLM(str(tiny), kv_cache_memory="16MiB", max_model_len=256, speculative="off")
    move = llm.runner.huge_pages
    assert move is not None and llm.resolved.huge_pages
    projections = [m for m in llm.runner.model.modules() if isinstance(m, BlockLinear)]
    before = [m.q.data_ptr() for m in projections]
    move.wait()
    tokens = _greedy(llm)  # its first step swaps the copies in
    assert llm.runner.huge_pages is None
    after = [m.q.data_ptr() for m in projections]
    assert all(a != b for a, b in zip(before, after)) and after[0] % HUGE_PAGE == 0
    layer = llm.runner.native_decode._layers[0]
    assert layer.qkv.q == llm.runner.model.layers[0].self_attn.qkv_proj.q.data_ptr()  # the native step's too
    monkeypatch.setattr(HugePageMove, "start", classmethod(lambda cls, model: None))
    stay = LLM(str(tiny), kv_cache_memory="16MiB", max_model_len=256, speculative="off")
    assert stay.runner.huge_pages is None
    assert _greedy(stay) == tokens


@NEEDS_HUGE_PAGES
def test_a_draft_model_swaps_its_own_weights_in_at_its_first_pass(tiny, monkeypatch):
    """The draft's runner is never ``run``: its passes are ``forward`` calls, where the swap is made."""
    from localpaged import LLM

    monkeypatch.setattr(setup, "available_memory", lambda: 1 << 40)
    llm = LLM(str(tiny), kv_cache_memory="16MiB", max_model_len=256, speculative={"draft": str(tiny), "k": 2})
    draft = llm.runner.drafter.runner
    projections = [m for m in draft.model.modules() if isinstance(m, BlockLinear)]
    before = [m.q.data_ptr() for m in projections]
    for move in (llm.runner.huge_pages, draft.huge_pages):
        move.wait()
    _greedy(llm)
    assert llm.runner.huge_pages is None and draft.huge_pages is None
    after = [m.q.data_ptr() for m in projections]
    assert all(a != b for a, b in zip(before, after)) and after[0] % HUGE_PAGE == 0


@NEEDS_HUGE_PAGES
def test_settle_swaps_the_copies_in_before_any_step(tiny, monkeypatch):
    """What a benchmark calls before its timed part: the model's and the draft's weights on their copies at once."""
    from localpaged import LLM

    monkeypatch.setattr(setup, "available_memory", lambda: 1 << 40)
    llm = LLM(str(tiny), kv_cache_memory="16MiB", max_model_len=256, speculative={"draft": str(tiny), "k": 2})
    draft = llm.runner.drafter.runner
    runners = (llm.runner, draft)
    before = [[m.q.data_ptr() for m in r.model.modules() if isinstance(m, BlockLinear)] for r in runners]
    llm.settle()
    assert llm.runner.huge_pages is None and draft.huge_pages is None
    for runner, ptrs in zip(runners, before):
        after = [m.q.data_ptr() for m in runner.model.modules() if isinstance(m, BlockLinear)]
        assert all(a != b for a, b in zip(ptrs, after)) and after[0] % HUGE_PAGE == 0
    llm.settle()  # nothing left to wait for
    monkeypatch.setattr(HugePageMove, "start", classmethod(lambda cls, model: None))
    stay = LLM(str(tiny), kv_cache_memory="16MiB", max_model_len=256, speculative={"draft": str(tiny), "k": 2})
    stay.settle()  # no move under way: nothing to do
    assert _greedy(llm) == _greedy(stay)


def test_nothing_moves_without_huge_pages_or_memory_for_a_copy(tiny, monkeypatch):
    """The engine's decision (setup.move_to_huge_pages), which its settled configuration reports."""
    from localpaged import LLM

    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    llm = LLM(str(tiny), kv_cache_memory="16MiB", max_model_len=256, speculative="off")
    assert not llm.resolved.huge_pages and llm.runner.huge_pages is None
    model, cpu_device = llm.runner.model, torch.device("cpu")
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    monkeypatch.setattr(setup, "available_memory", lambda: 1 << 40)
    assert setup.move_to_huge_pages([model], cpu_device)
    assert not setup.move_to_huge_pages([model], torch.device("meta"))  # a GPU's weights are not packed blocks
    monkeypatch.setattr(setup, "available_memory", lambda: setup.HUGE_PAGES_SPARE)  # no room for a copy
    assert not setup.move_to_huge_pages([model], cpu_device)
