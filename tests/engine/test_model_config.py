"""models/loader.load_config: a Llama config.json that states every field the engine reads is read without transformers
(``LlamaConfig``), with the values transformers' own config gives (the oracle), RoPE frequencies included; anything
else (another architecture, a field left to its default, another RoPE scaling) goes to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from localpaged.layers.rotary_embedding import rope_frequencies, rotary_dim_of
from localpaged.models.llama import head_dim_of
from localpaged.models.loader import LLAMA_FIELDS, LlamaConfig, load_config

READ = (*LLAMA_FIELDS, "eos_token_id", "model_type", "attention_bias", "mlp_bias")
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3 |= {"original_max_position_embeddings": 8192}


def folder_with(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def assert_as_transformers_reads_it(folder: Path) -> None:
    ours, theirs = load_config(folder), AutoConfig.from_pretrained(folder)
    assert isinstance(ours, LlamaConfig)
    for name in READ:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert head_dim_of(ours) == head_dim_of(theirs)
    assert getattr(ours, "sliding_window", None) == getattr(theirs, "sliding_window", None)
    head_dim = head_dim_of(ours)
    assert rotary_dim_of(ours, head_dim) == rotary_dim_of(theirs, head_dim)
    for positions in (4096, 131072):
        (a, scale_a), (b, scale_b) = (
            rope_frequencies(ours, head_dim, positions),
            rope_frequencies(theirs, head_dim, positions),
        )
        assert torch.equal(a, b) and scale_a == scale_b


def test_the_default_model_and_the_tiny_llama_are_read_as_transformers_reads_them(
    default_model_folder, tiny_model_path
):
    assert_as_transformers_reads_it(default_model_folder)
    assert_as_transformers_reads_it(tiny_model_path)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3},  # the older form (Llama 3.2's config.json)
        {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3}},  # transformers 5's
        {"rope_theta": 10000, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "rope_freq_factors": [1.0, 2.0] * 16},
    ],
)
def test_a_stated_llama_config_is_read_as_transformers_reads_it(tmp_path, default_model_folder, rope):
    config = json.loads((default_model_folder / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        config.pop(key, None)
    assert_as_transformers_reads_it(folder_with(tmp_path, config | rope | {"eos_token_id": [2, 5]}))


@pytest.mark.parametrize("change", ["no rms_norm_eps", "no eos_token_id", "longrope", "qwen2", "no rope_theta"])
def test_a_config_not_stated_in_full_goes_to_transformers(tmp_path, default_model_folder, change):
    config = json.loads((default_model_folder / "config.json").read_text())
    if change == "no rms_norm_eps":
        del config["rms_norm_eps"]
    elif change == "no eos_token_id":
        del config["eos_token_id"]
    elif change == "longrope":
        config["rope_parameters"] = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": [1.0] * 32,
            "short_factor": [1.0] * 32,
        }
    elif change == "qwen2":
        config["model_type"] = "qwen2"
    else:
        config.pop("rope_theta", None), config.pop("rope_parameters", None), config.pop("rope_scaling", None)
    assert not isinstance(load_config(folder_with(tmp_path, config)), LlamaConfig)
