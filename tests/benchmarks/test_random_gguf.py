"""benchmarks/random_gguf.py: the source's shape, types and tokenizer, a longer context, other weights; it loads."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from random_gguf import write_deepened_gguf, write_random_gguf

from localpaged import LLM, SamplingParams


def test_random_gguf_keeps_the_shape_raises_the_context_and_runs_past_the_old_one(tiny_gguf, tmp_path) -> None:
    out = write_random_gguf(tiny_gguf, tmp_path / "random.gguf", context=4096)
    source, copy = GGUFReader(tiny_gguf), GGUFReader(out)
    assert source.fields["llama.context_length"].contents() == 2048
    assert copy.fields["llama.context_length"].contents() == 4096
    tokenizer = [name for name in source.fields if name.startswith("tokenizer.")]
    assert tokenizer and all(copy.fields[n].contents() == source.fields[n].contents() for n in tokenizer)
    shapes = [(t.name, t.tensor_type, list(t.shape)) for t in source.tensors]
    assert [(t.name, t.tensor_type, list(t.shape)) for t in copy.tensors] == shapes
    matrices = [(a, b) for a, b in zip(source.tensors, copy.tensors) if len(a.shape) == 2]
    assert {"Q4_K", "Q8_0", "F16"} <= {a.tensor_type.name for a, _ in matrices}  # shuffled, quantised, plain
    assert not any(np.array_equal(a.data, b.data) for a, b in matrices)

    llm = LLM(str(out), max_model_len=4096, kv_cache_memory="64MiB", kv_disk=False)
    prompt = [1000 + i % 5000 for i in range(2100)]  # past the source's context
    reply = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    llm.close()
    assert reply.finish_reason == "length" and len(reply.token_ids) == 3


def test_a_deepened_gguf_answers_as_its_source_with_more_layers(tiny_gguf, tmp_path) -> None:
    out = write_deepened_gguf(tiny_gguf, tmp_path / "deep.gguf", extra_layers=3)
    source, deep = GGUFReader(tiny_gguf), GGUFReader(out)
    layers = source.fields["llama.block_count"].contents()
    assert deep.fields["llama.block_count"].contents() == layers + 3
    tensors = {t.name: t for t in deep.tensors}
    assert not tensors[f"blk.{layers}.ffn_down.weight"].data.any()
    assert np.array_equal(tensors[f"blk.{layers + 1}.ffn_up.weight"].data, tensors["blk.1.ffn_up.weight"].data)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    replies = []
    for path in (tiny_gguf, out):
        llm = LLM(str(path), kv_cache_memory="64MiB", kv_disk=False)
        replies.append(llm.generate(["Hello there", "Once upon a time"], params))
        llm.close()
    assert [r.token_ids for r in replies[0]] == [r.token_ids for r in replies[1]]
