"""The paged engine: sequences, block pool, scheduler, runner and the LLM front ends."""
