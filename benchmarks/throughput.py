"""16 chat sessions sharing one system prompt: our engine against Hugging Face transformers, in one run.

Every contender produces the same number of tokens per session (EOS ignored), greedy, float32
compute. Ours runs as configured by default (on the CPU: a GGUF's own blocks on the native kernels)
and, where that differs, with float32 weights too; on CUDA also in its default bf16. Prints aggregate
output tokens/s, the default's ratios to each peer, model memory, and the KV memory our pool held
against contiguous max-length reservations and against the same sessions without prefix sharing.

    python benchmarks/throughput.py [--sessions 16] [--tokens 128] [--device cpu|cuda] [--model PATH] [--skip-hf-sequential]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from kv_folder import own_kv_folder

from localpaged import LLM, SamplingParams

SYSTEM = (
    "You are a careful, friendly assistant for a small engineering team. Answer in plain English, "
    "prefer short paragraphs and concrete examples, and say so when you are unsure. When asked about "
    "code, explain what it does before suggesting changes, keep suggestions minimal, and mention any "
    "risk to existing behaviour. When asked about a process, list the steps in order and name who "
    "does each one. Never invent facts about the team, its tools or its history; ask instead. Keep "
    "answers under two hundred words unless the user asks for more detail. Use metric units. Format "
    "lists with hyphens, code with fenced blocks, and never use tables. If a question is ambiguous, "
    "answer the most likely reading and state the assumption in one sentence at the start. If a "
    "request could cause harm, decline briefly and suggest a safer alternative. Always be kind. "
    "Remember that the team works across three time zones and values written, asynchronous "
    "communication, so answers should stand on their own without a follow-up meeting. When you "
    "quote a command, give the exact command and say what it changes. When you compare two options, "
    "end with a clear recommendation and the one reason that decides it. When you are asked for a "
    "summary, keep the original order of events and name the decisions that were made, by whom, and "
    "what is still open. Prefer boring, proven tools over clever new ones, and say what it costs."
)
QUESTIONS = [
    "How do I write a good commit message?",
    "What is a race condition?",
    "Explain recursion to a child.",
    "Why is the sky blue?",
    "How does a hash map work?",
    "What makes a code review useful?",
    "How should I name variables?",
    "What is the difference between a thread and a process?",
    "How do I estimate a task?",
    "What is technical debt?",
    "How do caches speed programs up?",
    "Why write tests first?",
    "What is a memory leak?",
    "How does HTTPS keep data private?",
    "What is a good way to learn a new language?",
    "How do I run a useful retrospective?",
]


def conversations(n: int) -> list[list[dict]]:
    return [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        for i in range(n)
    ]


def run_ours(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """Aggregate tok/s and the peak number of blocks in use."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up; also caches the system prompt
    start = time.perf_counter()
    for p in prompts:
        llm.add_request(p, params)
    produced, peak = 0, 0
    while llm.has_unfinished_requests():
        produced += len(llm.step())
        peak = max(peak, llm.pool.num_used_blocks)  # not stats(): it walks every block, each step
    return produced / (time.perf_counter() - start), peak


def weight_bytes(llm: LLM) -> int:
    """Bytes of the model's parameters and buffers, each shared tensor counted once."""
    model = llm.runner.model
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@torch.inference_mode()
def run_hf_sequential(model, prompts: list[list[int]], tokens: int, device) -> float:
    start = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        )
    return len(prompts) * tokens / (time.perf_counter() - start)


@torch.inference_mode()
def run_hf_batch(model, prompts: list[list[int]], tokens: int, pad_id: int, device) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=pad_id
    )
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="a model folder or .gguf file; default: the default model")
    ap.add_argument("--skip-hf-sequential", action="store_true", help="the slowest peer; skip it for a quick look")
    args = ap.parse_args()

    results: dict[str, float] = {}
    weight_mib: dict[str, float] = {}
    ours32 = LLM(args.model, device=args.device, dtype="float32")
    prompts = [ours32.encode_chat(c) for c in conversations(args.sessions)]
    print(
        f"{args.sessions} sessions, system prompt {len(prompts[0]) - 10} tokens or so, prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {args.tokens} new tokens each, greedy, device {args.device}, torch threads {torch.get_num_threads()}"
    )
    blocks = ours32.resolved.weights == "auto"  # a GGUF's own blocks, float32 compute (the CPU default)
    name = "localpaged fp32, GGUF blocks (default)" if blocks else "localpaged fp32"
    results[name], peak = run_ours(ours32, prompts, args.tokens)
    weight_mib[name] = weight_bytes(ours32) / 2**20
    block_bytes, max_len, bs = ours32.block_bytes, ours32.resolved.max_model_len, ours32.resolved.block_size
    ours32.close()  # the disk tier's last writes, before own_kv_folder removes its folder
    del ours32
    if blocks:
        ours_float = LLM(args.model, device=args.device, dtype="float32", weights="float")
        results["localpaged fp32, float weights"], _ = run_ours(ours_float, prompts, args.tokens)
        weight_mib["localpaged fp32, float weights"] = weight_bytes(ours_float) / 2**20
        ours_float.close()
        del ours_float
    ours_auto = LLM(args.model, device=args.device)
    auto_dtype = str(next(ours_auto.runner.model.parameters()).dtype).removeprefix("torch.")
    if auto_dtype != "float32":
        results[f"localpaged default ({auto_dtype})"], _ = run_ours(ours_auto, prompts, args.tokens)
    ours_auto.close()
    del ours_auto

    from transformers import AutoModelForCausalLM

    from localpaged.models.loader import default_model_path

    source = Path(args.model) if args.model else default_model_path()  # a GGUF is read by transformers itself
    where = (
        {"pretrained_model_name_or_path": source.parent, "gguf_file": source.name}
        if source.is_file()
        else {"pretrained_model_name_or_path": source}
    )
    hf = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).to(args.device).eval()
    if not args.skip_hf_sequential:
        results["HF generate, one after another (fp32)"] = run_hf_sequential(hf, prompts, args.tokens, args.device)
    results[f"HF generate, padded batch of {args.sessions} (fp32)"] = run_hf_batch(
        hf, prompts, args.tokens, 2, args.device
    )

    print(f"\n{'contender':<44} {'tok/s':>8}")
    for name, tps in results.items():
        print(f"{name:<44} {tps:>8.1f}")
    default = f"localpaged default ({auto_dtype})" if auto_dtype != "float32" else next(iter(results))
    for name, tps in results.items():
        if name.startswith("HF"):
            print(f"{default} / {name}: {results[default] / tps:.1f}x")

    for name, mib in weight_mib.items():
        print(f"model weights in memory, {name}: {mib:.1f} MiB")

    per_seq = [-(-(len(p) + args.tokens) // bs) for p in prompts]
    mib = 2**20
    print("\nKV memory for these sessions (fp32 KV):")
    print(f"  localpaged pool, peak in use:                {peak * block_bytes / mib:8.1f} MiB ({peak} blocks)")
    print(f"  same sessions without prefix sharing:        {sum(per_seq) * block_bytes / mib:8.1f} MiB")
    print(
        f"  {args.sessions} contiguous max-length ({max_len}) reservations: {args.sessions * (max_len // bs) * block_bytes / mib:8.1f} MiB"
    )


if __name__ == "__main__":
    with own_kv_folder():  # cold means cold: no blocks from earlier runs
        main()
