"""Child process of the crash-safety test: streams a long reply until the parent SIGKILLs it.

Usage: crash_child.py DB_PATH TINY_MODEL_FOLDER. Prints the session id, then generates.
"""

import sys

from localpaged.chat.session import Session
from localpaged.chat.store import ChatStore
from localpaged.engine.async_llm import AsyncLLM
from localpaged.sampling import SamplingParams

db, model = sys.argv[1], sys.argv[2]
engine = AsyncLLM(model, dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=2048)
session = Session.new(engine, ChatStore(db))
print(session.id, flush=True)
session.send("Write a very long story.", SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True))
print("finished without being killed", file=sys.stderr)
sys.exit(1)
