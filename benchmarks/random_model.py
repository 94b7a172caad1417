"""Write a random-weight copy of a model folder: same config and tokenizer, new weights.

The GPU machine cannot receive the default model (a 98 MB GGUF; a call carries 64 MiB), so
gpu_check.sh builds this stand-in there from the config and tokenizer files alone. Its shape, and
so its speed, is the real model's; Hugging Face loads the same folder as the parity oracle.

    python benchmarks/random_model.py SOURCE_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(source: Path, out: Path) -> None:
    config = AutoConfig.from_pretrained(source)
    config.initializer_range = 0.2  # peaked logits, so greedy choices are rarely near-ties
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
