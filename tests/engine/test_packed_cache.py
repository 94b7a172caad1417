"""A GGUF's projections packed once and mapped at later starts: the same weights and output, never another model's or
kernel version's packing, a damaged file packed again, the folder bounded."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from localpaged.kernels import cpu
from localpaged.layers.linear import BlockLinear
from localpaged.models import packed_cache
from localpaged.models.packed_cache import FILE, KEEP
from tests.gguf_models import tiny_hf_model, write_gguf

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="the native CPU kernels are not built here")
TYPES = {"token_embd.weight": "Q4_K", "blk.0.attn_q.weight": "Q5_0", "blk.1.ffn_down.weight": "Q6_K"}


@pytest.fixture
def models(tmp_path, monkeypatch) -> Path:
    """A packed cache of the test's own (the kernels stay in the shared test cache: no rebuild)."""
    folder = tmp_path / "models"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(packed_cache, "models_cache_dir", lambda: folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gguf_tokenizer) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return write_gguf(path, tiny_hf_model("llama"), "llama", TYPES, gguf_tokenizer)


def _llm(path: Path, activations: str = "float32"):
    from localpaged import LLM

    return LLM(str(path), activations=activations, kv_cache_memory="16MiB", max_model_len=256)


def _projections(llm) -> dict[str, BlockLinear]:
    return {n: m for n, m in llm.runner.model.named_modules() if isinstance(m, BlockLinear)}


def _greedy(llm) -> list[int]:
    from localpaged import SamplingParams

    out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return out[0].token_ids


def _packed_folders(models: Path) -> list[Path]:
    return sorted(p for p in models.glob("*-packed-*") if not p.name.startswith("."))


def test_a_second_start_maps_the_packing_of_the_first_and_runs_the_same(models, tiny, monkeypatch):
    first = _llm(tiny)
    (folder,) = _packed_folders(models)
    assert (folder / FILE).stat().st_mode & 0o077 == 0  # the user's own, like the rest of the cache
    want = _greedy(first)
    packed = {n: m.packed for n, m in _projections(first).items()}

    def no_packing(*args, **kwargs):
        raise AssertionError("a cached projection was packed again")

    monkeypatch.setattr(cpu, "pack_blocks", no_packing)
    second = _llm(tiny)
    again = _projections(second)
    layers = first.runner.model.config.num_hidden_layers
    assert sorted(again) == sorted(packed) and len(packed) == 4 * layers + 1  # every projection, the tied head too
    for name, module in again.items():
        for field in packed_cache.FIELDS:
            assert getattr(module.packed, field) == getattr(packed[name], field), (name, field)
        for field in cpu.PACKED_TENSORS:
            a, b = getattr(module.packed, field), getattr(packed[name], field)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, field)
    assert _greedy(second) == want


def test_each_activations_type_has_its_own_packing(models, tiny):
    _llm(tiny, "float32")
    _llm(tiny, "int8")  # packed in quads: another layout
    assert [p.name.split("-packed-")[1].split("-")[0] for p in _packed_folders(models)] == ["float32", "int8"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),  # cut short
        lambda f: f.write_bytes(b"\xff" * 64),  # not safetensors at all
        lambda f: f.chmod(0o666),  # writable by others: not trusted
    ],
    ids=["truncated", "garbage", "writable-by-others"],
)
def test_a_damaged_or_untrusted_packing_is_set_aside_and_packed_again(models, tiny, damage):
    want = _greedy(_llm(tiny))
    (folder,) = _packed_folders(models)
    damage(folder / FILE)
    with pytest.warns(UserWarning, match=r"not using .*-packed-"):
        llm = _llm(tiny)
    assert _greedy(llm) == want
    (again,) = _packed_folders(models)
    assert (again / FILE).stat().st_mode & 0o077 == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _llm(tiny)  # the rewritten packing is trusted


def test_a_packing_that_lacks_projections_or_holds_others_is_replaced(models, tiny):
    want = _greedy(_llm(tiny))
    (folder,) = _packed_folders(models)
    packs = packed_cache._read(folder / FILE)
    packs["layers.9.mlp.gate_up_proj"] = packs.pop("layers.0.mlp.gate_up_proj")
    packed_cache._write(folder / FILE, packs)
    (folder / FILE).chmod(0o600)
    with pytest.warns(UserWarning, match="does not hold this model's projections"):
        llm = _llm(tiny)
    assert _greedy(llm) == want
    (again,) = _packed_folders(models)
    assert sorted(packed_cache._read(again / FILE)) == sorted(_projections(llm))


def test_older_packings_and_those_past_the_last_used_are_removed(models, tiny, gguf_tokenizer, tmp_path):
    _llm(tiny)
    (current,) = _packed_folders(models)
    stale = current.with_name(current.name.rsplit("-", 1)[0] + "-0123456789abcdef")  # another kernel version's
    shutil.copytree(current, stale)
    version = current.name.rsplit("-", 1)[1]
    unused = []
    for i in range(KEEP):
        old = models / f"{i:032x}-packed-float32-{version}"
        shutil.copytree(current, old)
        os.utime(old, (1e9 + i, 1e9 + i))
        unused.append(old)
    other = write_gguf(tmp_path / "other.gguf", tiny_hf_model("qwen2"), "qwen2", TYPES, gguf_tokenizer)
    _llm(other)  # writes its packing: the folders kept are the KEEP used last
    kept = _packed_folders(models)
    assert len(kept) == KEEP and current in kept and stale not in kept
    assert [p for p in unused if p in kept] == unused[-(KEEP - 2) :]


def test_no_room_on_disk_starts_all_the_same_and_writes_nothing(models, tiny, monkeypatch, caplog):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1 << 20))
    want = _greedy(_llm(tiny))
    assert "not keeping this model's packed weights" in caplog.text
    assert _packed_folders(models) == []
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert _greedy(_llm(tiny)) == want
    assert len(_packed_folders(models)) == 1
