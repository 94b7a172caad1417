"""Model loading and the Llama-family forward pass over the paged KV cache."""

from collections.abc import Callable

# How loading reports itself: a step in words and its fraction done (None: no measure, the bar pulses).
# Here, not in the loader, so that the front ends name it without importing torch.
Progress = Callable[[str, "float | None"], None]
