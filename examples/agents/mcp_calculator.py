"""An MCP server with arithmetic tools, written with the official `mcp` package; the agent loop calls its tools.

    rollout.multi_turn.mcp_servers=[{command: python, args: [examples/agents/mcp_calculator.py]}]

rlframe starts it over stdio (and stops it at the end). The same file serves streamable HTTP on loopback for a
server that outlives the run:

    python examples/agents/mcp_calculator.py --http 8931
    rollout.multi_turn.mcp_servers=[{url: "http://127.0.0.1:8931/mcp"}]

Nothing here knows about rlframe: any MCP client (an IDE, an agent SDK) can use the same server.
"""

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def subtract(a: int, b: int) -> str:
    """Subtract b from a."""
    return str(a - b)


@server.tool()
def multiply(a: int, b: int) -> str:
    """Multiply two integers."""
    return str(a * b)


if __name__ == "__main__":
    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run()
