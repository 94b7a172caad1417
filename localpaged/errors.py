"""The exceptions users see. Each message says what is wrong and what to do about it."""


class LocalpagedError(Exception):
    """Base class of every error localpaged raises on purpose."""


class ConfigError(LocalpagedError, ValueError):
    """A setting or argument is out of range, or the settings cannot work together."""


class ModelNotFoundError(LocalpagedError, FileNotFoundError):
    """The model path does not exist, or the default model package is not installed."""


class InvalidModelError(LocalpagedError, ValueError):
    """The model file is there but is not a readable model (an empty, truncated or damaged .gguf)."""


class UnsupportedModelError(LocalpagedError):
    """The checkpoint's architecture is not one the engine implements."""


class RequestError(LocalpagedError, ValueError):
    """A request cannot be served as given (too long, empty, duplicate id, unknown id)."""


class EngineDeadError(LocalpagedError):
    """The engine core process is gone (killed, crashed, out of memory); start a new engine to go on."""


class RemoteEngineError(LocalpagedError):
    """A remote engine's server cannot be reached, timed out, or failed; the message names its URL.

    Unlike EngineDeadError nothing here died for good: the next request may well get through.
    """


class KernelError(LocalpagedError):
    """The native CPU kernels cannot be used as installed (the library reports another ABI version than
    kernels/cpu.py expects), or a kernel failed while running (out of memory for its scratch buffers)."""


class KernelArgumentError(KernelError, ValueError):
    """A native CPU kernel was handed a tensor it cannot read: wrong dtype, shape, device or layout, or an
    index outside the KV cache. The message names the argument."""


class StoreError(LocalpagedError):
    """The chat database cannot be opened, read or written."""


class UnknownSessionError(StoreError, KeyError):
    """No stored session has the given id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PromptError(LocalpagedError):
    """A system prompt is missing or its file is malformed."""


class ToolError(LocalpagedError):
    """A tool call failed: the tool raised, its MCP server answered with an error or is not running. The
    message goes back to the model as the call's result, and is shown to the user under the call."""
