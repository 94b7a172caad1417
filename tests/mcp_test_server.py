"""A stdio MCP server for the tool tests, written with the SDK: ``answer`` answers, ``fail`` always fails.

``--slow SECONDS`` waits before serving (a server slow to start); ``--die`` exits at once (a broken one).
"""

from __future__ import annotations

import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("localpaged-test")


@server.tool()
def answer(question: str) -> str:
    """Answer a question with the test server's fixed fact about it."""
    return f"The answer to {question!r} is 42."


@server.tool()
def fail(reason: str) -> str:
    """A tool that always fails, saying why."""
    raise ToolError(f"fail was asked to fail: {reason}")


if __name__ == "__main__":
    if "--die" in sys.argv:
        sys.exit("this test server is broken on purpose")
    if "--slow" in sys.argv:
        time.sleep(float(sys.argv[sys.argv.index("--slow") + 1]))
    server.run("stdio")
