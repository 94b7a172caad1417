"""Model loading and the Llama-family forward pass over the paged KV cache."""
