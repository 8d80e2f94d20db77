"""Runs one episode of a user's agent function in its own process: `python episode_runner.py FILE NAME RESULT`.

The row arrives as JSON on standard input; `NAME(row)` is called; its return value (text, or a dict with `answer`
and optionally `reward`) is written as JSON to the file RESULT. Standard library only, and nothing of rlframe
is imported, so a fresh process starts in well under a second. An exception exits with status 1 (the traceback
on stderr, which the episode runner keeps); the caller kills the process group at the episode's deadline.
"""

import importlib.util
import json
import sys
import traceback


def main(path: str, name: str, result_path: str) -> int:
    row = json.loads(sys.stdin.read() or "{}")
    spec = importlib.util.spec_from_file_location("rlframe_agent_program", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlframe_agent_program"] = module
    spec.loader.exec_module(module)
    answer = getattr(module, name)(row)
    if not isinstance(answer, (str, dict)) and answer is not None:
        answer = str(answer)
    with open(result_path, "w") as f:
        json.dump({"answer": answer}, f, default=str)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(*sys.argv[1:4]))
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
