"""`python -m rlframe.board [--host 127.0.0.1] [--port 7860] [--auth-file PATH] [--allowed-host NAME]
[--ssl-certfile F --ssl-keyfile F] [--workspace DIR] [--lang en|zh]`: prints the URL to log in with (its token)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlframe.board.security import BoardError, bind_rules

MAX_UPLOAD_MB = 512


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlframe.board", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                        "only; reach it from elsewhere through an SSH tunnel, or serve it with TLS)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--auth", default=None, help=argparse.SUPPRESS)  # refused with its fix (bind_rules)
    parser.add_argument("--auth-file", default=None,
                        help="a file whose first line is the login password (8+ characters; or set "
                             "RLFRAME_BOARD_PASSWORD); without it, log in with the token printed at start")
    parser.add_argument("--allowed-host", action="append", default=[],
                        help="another Host name the board answers to (a proxy's or this machine's DNS name); "
                             "repeatable. localhost, 127.0.0.1, ::1 and --host always are")
    parser.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--max-upload-mb", type=int, default=MAX_UPLOAD_MB, help="the largest upload accepted")
    parser.add_argument("--workspace", default="board_workspace",
                        help="the board's folder: runs/, uploads/, exports/, settings/, logs/ (default ./board_workspace)")
    parser.add_argument("--lang", choices=["en", "zh"], default="en", help="the labels' language (a drop-down switches it)")
    return parser.parse_args(argv)


def tls_files(args: argparse.Namespace) -> bool:
    """True when both TLS files are given (and exist); BoardError when only one is, or one is missing."""
    given = [f for f in (args.ssl_certfile, args.ssl_keyfile) if f]
    if not given:
        return False
    if len(given) == 1:
        raise BoardError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    for name, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if not Path(path).is_file():
            raise BoardError(f"{name} {path}: no such file")
    return True


def serve(args: argparse.Namespace, block: bool = True):
    """Build the page and start serving behind the login and the Host/Origin guard; returns (gradio's app, the
    URL to log in with, token included) when not blocking."""
    from starlette.middleware import Middleware

    from rlframe.board.login import Guard, Login, allowed_hosts, read_password

    tls = tls_files(args)
    warning = bind_rules(args.host, args.auth, tls)
    if args.max_upload_mb < 1:
        raise BoardError("--max-upload-mb must be 1 or more")
    login = Login.new(password=read_password(args.auth_file))
    workspace = Path(args.workspace).resolve()
    # gradio's own copies of uploaded files (before the board checks and keeps them) stay in the workspace too
    os.environ["GRADIO_TEMP_DIR"] = str(workspace / "uploads" / ".incoming")
    from rlframe.board.actions import Board
    from rlframe.board.app import CSS, build_app

    board = Board(workspace)
    app = build_app(board, args.lang)
    app.board_login = login  # (the sessions and failed tries, for whoever holds the app)
    guard = Middleware(Guard, login=login, hosts=allowed_hosts(args.host, args.allowed_host), port=args.port,
                       secure=tls)
    scheme = "https" if tls else "http"
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"{scheme}://{shown}:{args.port}/?token={login.token}"
    print(f"rlframe board on {scheme}://{args.host}:{args.port}/; workspace {board.workspace}\n"
          f"log in: {url}" + (" (or with the password)" if login.password else "") + "\n"
          "(the token is new at each start; anyone holding it can launch runs, which run code on this machine)"
          + (f"\n{warning}" if warning else ""), flush=True)
    app.queue(default_concurrency_limit=4)
    app.launch(server_name=args.host, server_port=args.port, prevent_thread_lock=not block,
               allowed_paths=[str(board.workspace)], css=CSS, quiet=True, footer_links=[], show_error=True,
               app_kwargs={"middleware": [guard]}, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
               ssl_verify=False, max_file_size=f"{args.max_upload_mb}mb")
    return app, url


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        serve(args)
    except BoardError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
