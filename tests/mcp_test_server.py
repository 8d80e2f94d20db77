"""A small MCP server for the tests (written with the `mcp` package, as a user writes one): stdio by default,
streamable HTTP on loopback with `--http PORT`."""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("rlframe-test")


@server.tool()
def echo(text: str) -> str:
    """Repeat the text."""
    return f"mcp-echo:{text}"


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def fail(text: str) -> str:
    """Always raises."""
    raise ValueError(f"the server tool failed on {text}")


@server.tool()
def nap(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


@server.tool()
def getenv(name: str) -> str:
    """The value of an environment variable of this server process, or <unset>."""
    return os.environ.get(name, "<unset>")


@server.tool()
def crash() -> str:
    """The process exits at once (a server that dies)."""
    print("crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    if "--fail-at-start" in sys.argv:
        print("cannot open the database", file=sys.stderr, flush=True)
        sys.exit(2)
    if "--http" in sys.argv:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        server.run()
