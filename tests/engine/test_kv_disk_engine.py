"""The disk KV tier inside the engine, on the tiny model: size limit, blocks evicted from memory and read back,
prefetch, turning it off, and the weights' remembered digests."""

from __future__ import annotations

import types

import pytest

from localpaged import SamplingParams
from localpaged.config import EngineConfig, ResolvedConfig
from localpaged.errors import ConfigError
from localpaged.models import weights_digest

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SMALL_POOL = {"kv_cache_memory": "640KiB", "kv_cache_dtype": "float32", "max_model_len": 1024}  # 80 blocks of 8 KiB


def prompt(i: int, n: int = 160) -> list[int]:
    return [1000 + (i * 7919 + j * 31) % 30000 for j in range(n)]


def disk_files(llm) -> list:
    return list(llm.kv_disk.folder.glob("*.kvb"))


def test_the_size_limit_holds_after_many_chats(tiny_llm):
    block_file = tiny_llm().block_bytes + 400  # the tiny model's block (default KV dtype) and its header
    llm = tiny_llm(kv_disk_bytes=12 * block_file)
    for i in range(0, 24, 4):
        llm.generate([prompt(i + k, 60) for k in range(4)], GREEDY)
    llm.close()
    assert sum(f.stat().st_size for f in disk_files(llm)) <= 12 * block_file
    assert llm.stats().disk_blocks == len(disk_files(llm)) > 0
    llm.pool.check_integrity()
    assert llm.pool.num_used_blocks == 0


def test_blocks_evicted_from_memory_come_back_from_disk_with_the_same_output(tiny_llm):
    llm = tiny_llm(**SMALL_POOL)
    first = llm.generate([prompt(0, 400)], GREEDY)[0]
    for i in range(1, 5):  # 4 x 26 blocks through an 80-block pool evict the first prompt's blocks
        llm.generate([prompt(i, 400)], GREEDY)
    llm.kv_disk.flush()
    again = llm.generate([prompt(0, 400)], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.metrics.disk_tokens > 0 and again.metrics.disk_tokens <= again.metrics.cached_tokens
    assert llm.stats().disk_tokens == again.metrics.disk_tokens
    llm.pool.check_integrity()
    assert llm.pool.num_used_blocks == 0


def test_prefetch_loads_a_prompt_before_it_is_sent(tiny_llm):
    llm = tiny_llm()
    cold = llm.generate([prompt(1, 100)], GREEDY)[0]
    llm.close()
    restarted = tiny_llm()
    assert restarted.prefetch(prompt(1, 100)) == 96  # every full block
    assert restarted.prefetch(prompt(1, 100)) == 0  # already in memory
    assert restarted.pool.num_used_blocks == 0 and restarted.stats().blocks_cached == 6
    warm = restarted.generate([prompt(1, 100)], GREEDY)[0]
    assert warm.token_ids == cold.token_ids
    assert warm.metrics.cached_tokens == warm.metrics.disk_tokens == 96
    restarted.pool.check_integrity()


def test_the_tier_can_be_turned_off(tiny_llm, kv_disk):
    llm = tiny_llm(kv_disk=False)
    llm.generate([prompt(2, 100)], GREEDY)
    assert llm.kv_disk is None and llm.prefetch(prompt(2, 100)) == 0
    assert not list(kv_disk.rglob("*.kvb"))


@pytest.mark.parametrize(("field", "value"), [("kv_disk", "yes"), ("kv_disk_bytes", "lots"), ("kv_disk_bytes", 0)])
def test_bad_tier_settings_name_the_setting(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def test_a_weight_files_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALPAGED_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"a" * 1000)
    first = weights_digest.file_sha256(weights)
    real = weights_digest.hashlib

    def refuse(*args):
        raise AssertionError("the file was hashed again")

    monkeypatch.setattr(weights_digest, "hashlib", types.SimpleNamespace(sha256=refuse))
    assert weights_digest.file_sha256(weights) == first
    monkeypatch.setattr(weights_digest, "hashlib", real)
    weights.write_bytes(b"b" * 1000)  # same size, new content (and mtime)
    assert weights_digest.file_sha256(weights) != first


def test_each_cpu_kernel_path_has_its_own_disk_tier(tiny_model_path, monkeypatch):
    """The AVX-512, AVX2 and portable kernels may round the last bits differently: KV one wrote, another never reads."""
    import torch

    from localpaged.engine.setup import open_kv_disk
    from localpaged.kernels import cpu, cpu_isa
    from localpaged.models.loader import load_config, resolve_model

    names = [path.name for path in cpu_isa.PATHS if path.cpu_flags <= cpu_isa.cpu_flags()]
    if cpu.library() is None or len(names) < 2:
        pytest.skip("fewer than two native kernel paths run here")
    files = resolve_model(str(tiny_model_path))
    hf_config = load_config(files.folder)
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    folders = {}
    try:
        for name in names:
            monkeypatch.setenv(cpu_isa.ENV, name)
            cpu.chosen_path.cache_clear()
            cpu.library.cache_clear()
            resolved = ResolvedConfig(
                device="cpu",
                dtype="float32",
                kv_cache_dtype="float16",
                weights="auto",
                activations="float32",
                attention="torch",
                cpu_kernels=name,
                max_model_len=1024,
                max_num_batched_tokens=512,
                max_num_seqs=64,
                block_size=16,
                kv_cache_bytes=0,
                num_blocks=0,
                enable_prefix_caching=True,
                kv_disk=True,
                cascade_attention=True,
            )
            tier = open_kv_disk(
                resolved,
                2**30,
                files,
                hf_config,
                head_dim,
                types.SimpleNamespace(name="torch"),
                torch.device("cpu"),
                torch.float32,
                torch.float16,  # the KV type "auto" gives on the native kernels
            )
            folders[name] = tier.folder
            tier.close()
    finally:
        cpu.chosen_path.cache_clear()  # the next caller chooses again, once the variable is restored
        cpu.library.cache_clear()
    assert len(set(folders.values())) == len(names)
