"""The layers a model is built from, as nano-vllm's layers/: each picks its kernel (native CPU, Triton or torch)."""
