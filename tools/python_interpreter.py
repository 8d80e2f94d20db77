"""A Python code-interpreter tool: runs the model's code in rlframe's sandbox and returns what it printed.

    rollout.multi_turn.tools=[{path: tools/python_interpreter.py, name: python}]

Each call is a fresh, locked-down child process (rlframe/reward/sandbox.py: resource limits, no network,
a temporary working directory, a wall-clock deadline after which the process group is killed).
"""

TOOL_SCHEMAS = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program and return its standard output (use print).",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program"}},
                "required": ["code"],
            },
        },
    }
}

_SANDBOX = None
WALL_TIME_S = 3.0
MAX_OUTPUT_CHARS = 2000


def _sandbox():
    global _SANDBOX
    if _SANDBOX is None:
        from rlframe.reward.sandbox import Sandbox, SandboxLimits

        _SANDBOX = Sandbox(max_concurrency=4, limits=SandboxLimits(wall_time_s=WALL_TIME_S, cpu_time_s=WALL_TIME_S))
    return _SANDBOX


def python(code: str) -> str:
    """stdout of the program; on a failure, the end of stderr (the traceback) or the timeout."""
    result = _sandbox().run(code)
    if result.verdict == "timeout":
        return f"Error: the program did not finish within {WALL_TIME_S:g} s"
    if result.verdict != "passed":
        return ("Error: " + (result.stderr.strip() or f"exit code {result.exit_code}"))[-MAX_OUTPUT_CHARS:]
    return result.stdout[:MAX_OUTPUT_CHARS] or "(no output)"
