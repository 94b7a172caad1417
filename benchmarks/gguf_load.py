"""What running a GGUF as it is costs: first and warm start, RSS, cache disk, one-chat decode, greedy parity.

    python benchmarks/gguf_load.py [MODEL ...]      (default: the default model; e.g. a Q4_K_M requantization)

Each start runs in a fresh process; "first" uses an empty model cache (the compiled kernels are copied
in, so only the GGUF's own first-use cost is measured). Load time is LLM() after Python's imports.
Decode is one chat of 64 greedy tokens. Parity compares 32 greedy tokens with transformers reading
the same file (it dequantises through gguf-py to float32).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch, transformers  # imports are not load time
from localpaged import LLM, SamplingParams
start = time.perf_counter()
llm = LLM(sys.argv[1] or None, kv_cache_memory="256MiB", max_model_len=2048)
load_s = time.perf_counter() - start
chat = [{"role": "user", "content": "Tell me about the history of Rome in detail."}]
out = llm.chat([chat], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
start = time.perf_counter()
out = llm.chat([chat], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))[0]
decode = (len(out.token_ids) - 1) / (time.perf_counter() - start - out.metrics.ttft_s)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": load_s, "decode_tok_s": decode, "peak_rss": rss, "kv_bytes": llm.stats().blocks_total * llm.block_bytes,
                  "prompt": llm.encode_chat(chat), "tokens": out.token_ids}))
"""


def run_child(model: str, cache: Path) -> dict:
    env = {**os.environ, "LOCALPAGED_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def hf_greedy(model: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def main() -> None:
    from localpaged.locations import kernels_cache_dir
    from localpaged.models.loader import default_model_path

    for model in sys.argv[1:] or [str(default_model_path())]:
        cache = Path(tempfile.mkdtemp(prefix="gguf-load-"))
        try:
            shutil.copytree(kernels_cache_dir(), cache / "kernels")
            first = run_child(model, cache)
            disk = sum(f.stat().st_size for f in (cache / "models").rglob("*") if f.is_file())
            warm = run_child(model, cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        size = Path(model).stat().st_size
        theirs = hf_greedy(Path(model), warm["prompt"], 32)
        same = next((i for i, (a, b) in enumerate(zip(warm["tokens"], theirs)) if a != b), len(theirs))
        print(
            f"{Path(model).name}: file {size / 2**20:.0f} MiB | first start {first['load_s']:.2f} s, warm "
            f"{warm['load_s']:.2f} s | cache {disk / 2**20:.1f} MiB | peak RSS {warm['peak_rss'] / 2**20:.0f} MiB "
            f"(file + KV pool {(size + warm['kv_bytes']) / 2**20:.0f} MiB) | decode {warm['decode_tok_s']:.1f} tok/s | "
            f"greedy = transformers for {same}/{len(theirs)} tokens"
        )


if __name__ == "__main__":
    main()
