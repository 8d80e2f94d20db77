"""`python -m rlframe.board [--host 127.0.0.1] [--port 7860] [--auth user:password] [--workspace DIR] [--lang en|zh]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlframe.board.security import BoardError, bind_rules


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlframe.board", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (another than 127.0.0.1 needs --auth)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--auth", default=None, help="user:password, or a token (the password of user 'rlframe')")
    parser.add_argument("--workspace", default="board_workspace",
                        help="the board's folder: runs/, uploads/, exports/, settings/, logs/ (default ./board_workspace)")
    parser.add_argument("--lang", choices=["en", "zh"], default="en", help="the labels' language (a drop-down switches it)")
    return parser.parse_args(argv)


def serve(args: argparse.Namespace, block: bool = True):
    """Build the page and start serving; returns gradio's (app, local url, share url) when not blocking."""
    auth, start_line = bind_rules(args.host, args.auth)
    workspace = Path(args.workspace).resolve()
    # gradio's own copies of uploaded files (before the board checks and keeps them) stay in the workspace too
    os.environ["GRADIO_TEMP_DIR"] = str(workspace / "uploads" / ".incoming")
    from rlframe.board.actions import Board
    from rlframe.board.app import CSS, build_app

    board = Board(workspace)
    app = build_app(board, args.lang)
    print(start_line.format(port=args.port) + f"; workspace {board.workspace}", flush=True)
    app.queue(default_concurrency_limit=4)
    return app, app.launch(server_name=args.host, server_port=args.port, auth=auth, prevent_thread_lock=not block,
                           allowed_paths=[str(board.workspace)], css=CSS, quiet=True, footer_links=[],
                           show_error=True)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        serve(args)
    except BoardError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
