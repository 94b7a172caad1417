"""Child process of the Ctrl-C test: a plain script streaming through AsyncLLM, to be interrupted.

Prints "streaming" once output flows; the parent then sends SIGINT and times the exit.
"""

import faulthandler
import signal

from localpaged.engine.async_llm import AsyncLLM
from localpaged.sampling import SamplingParams
from tests.engine.fake_llm import FakeLLM

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if we hang
# Ctrl-C as in a terminal: a test run started in the background (`make test &`) hands its children SIGINT ignored,
# and Python then installs no KeyboardInterrupt handler at all.
signal.signal(signal.SIGINT, signal.default_int_handler)
engine = AsyncLLM(llm=FakeLLM(reply=lambda ids: "s" * 100_000, step_delay=0.005))
for output in engine.iter_stream("never ending", SamplingParams(max_tokens=100_000)):
    if len(output.text) == 3:
        print("streaming", flush=True)
