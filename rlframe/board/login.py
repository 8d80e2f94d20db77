"""Who may use the board: a login on every route (a token printed at start, or a chosen password), and a Host /
Origin allow-list in front of every route, as one ASGI middleware around gradio's FastAPI app.

    login = Login.new(password=read_password(args.auth_file))   # the token: secrets.token_urlsafe, new each start
    guard = Guard(app, login=login, hosts=allowed_hosts("127.0.0.1", []), port=7860, secure=False)

Modelled on Jupyter's server: the start line prints `http://127.0.0.1:PORT/?token=...`; opening it sets an
HttpOnly, SameSite=Strict session cookie and redirects to the page without the token; `/login` takes the token or
the password (from `--auth-file` or RLFRAME_BOARD_PASSWORD, never the command line, where `ps` shows it to every
user); `Authorization: token <token>` works for scripts. After LOGIN_FAILURES wrong tries from one address, that
address is refused (429) for LOCKOUT_S seconds. Every request, the login page included, must name an allowed Host
(the bound address, localhost, 127.0.0.1, ::1 and each `--allowed-host`) and, when it has an Origin, an allowed
host on the board's port: a page elsewhere that points a DNS name at 127.0.0.1 (DNS rebinding), or a cross-site
form or fetch, is refused with 403 before gradio sees it.
"""

from __future__ import annotations

import hmac
import html
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from urllib.parse import parse_qs, quote, urlencode, urlsplit

from rlframe.board.security import BoardError

PASSWORD_ENV = "RLFRAME_BOARD_PASSWORD"
LOGIN_FAILURES = 5  # wrong tries from one address before it is locked out
LOCKOUT_S = 60.0
SESSION_S = 7 * 24 * 3600.0
MIN_PASSWORD = 8
LOGIN_BODY_LIMIT = 4096
# gradio's own start check (`launch` asks it once, without a cookie): idempotent, answered to loopback only
OPEN_FROM_LOOPBACK = ("/gradio_api/startup-events",)
LOOPBACK_CLIENTS = ("127.0.0.1", "::1", "localhost")


def read_password(auth_file: str | None) -> str | None:
    """The chosen password: the first line of `auth_file`, else $RLFRAME_BOARD_PASSWORD, else None (token only)."""
    if auth_file:
        try:
            lines = Path(auth_file).read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise BoardError(f"--auth-file {auth_file} cannot be read ({err.strerror}). Fix: a file holding the "
                             "password on its first line (chmod 600 it)") from None
        password, where = (lines[0].strip() if lines else ""), f"--auth-file {auth_file}"
    else:
        password, where = os.environ.get(PASSWORD_ENV), PASSWORD_ENV
        if password is None:
            return None
    if len(password) < MIN_PASSWORD:
        raise BoardError(f"{where}: the password needs {MIN_PASSWORD} characters or more. Fix: a longer password "
                         "(or none: the board prints a login token at start)")
    return password


def allowed_hosts(bound: str, extra: list[str]) -> set[str]:
    """The Host names a request may carry: loopback names, the bound address (and this machine's names when it is
    0.0.0.0 / ::) and each --allowed-host."""
    hosts = {"localhost", "127.0.0.1", "::1", bound.strip("[]").lower()}
    if bound in ("0.0.0.0", "::"):
        hosts |= {socket.gethostname().lower(), socket.getfqdn().lower()}
    hosts |= {h.strip().strip("[]").lower() for h in extra if h.strip()}
    return hosts - {"0.0.0.0", "::", ""}


def host_name(value: str) -> str:
    """`name:port`, `[v6]:port` or `name` -> the lower-case name (no port, no brackets)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass
class Login:
    """The secrets and the sessions: the token (always), the password (optional), failed tries per address."""

    token: str
    password: str | None = None
    sessions: dict[str, float] = field(default_factory=dict)  # session id -> expiry (time.time())
    failures: dict[str, list[float]] = field(default_factory=dict)  # client address -> times of wrong tries

    @classmethod
    def new(cls, password: str | None = None) -> Login:
        return cls(token=secrets.token_urlsafe(32), password=password)

    def secret_ok(self, value: str, token_only: bool = False) -> bool:
        value = value or ""
        if hmac.compare_digest(value.encode(), self.token.encode()):
            return True
        return (not token_only and self.password is not None
                and hmac.compare_digest(value.encode(), self.password.encode()))

    def locked(self, client: str) -> float:
        """Seconds until `client` may try again (0: it may)."""
        now = time.monotonic()
        recent = [t for t in self.failures.get(client, []) if now - t < LOCKOUT_S]
        self.failures[client] = recent
        return LOCKOUT_S - (now - recent[-LOGIN_FAILURES]) if len(recent) >= LOGIN_FAILURES else 0.0

    def failed(self, client: str) -> None:
        self.failures.setdefault(client, []).append(time.monotonic())

    def open_session(self) -> str:
        session = secrets.token_urlsafe(32)
        self.sessions[session] = time.time() + SESSION_S
        return session

    def session_ok(self, session: str | None) -> bool:
        expiry = self.sessions.get(session or "")
        if expiry is None:
            return False
        if expiry < time.time():
            self.sessions.pop(session, None)
            return False
        return True


LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>rlframe board: log in</title>
<style>body{{font-family:sans-serif;max-width:32em;margin:4em auto}}input{{font-size:1em;padding:.3em;width:100%}}
.err{{color:#b00}}</style></head><body><h2>rlframe board</h2>
<p>Log in with the token the board printed at start (or the password of its --auth-file / {env}).</p>
<p class="err">{message}</p>
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<input type="password" name="secret" autofocus placeholder="token or password"><p><button>Log in</button></p>
</form></body></html>"""


class Guard:
    """ASGI middleware: Host / Origin allow-list, then the login, in front of every route of the app it wraps."""

    def __init__(self, app, login: Login, hosts: set[str], port: int, secure: bool = False):
        self.app, self.login, self.hosts, self.port, self.secure = app, login, hosts, port, secure
        self.cookie = f"rlframe-board-{port}"

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self.origin_problem(headers)
        if refused:
            return await self.respond(scope, receive, send, 403, refused)
        path, client = scope.get("path", ""), (scope.get("client") or ("", 0))[0]
        if path == "/login" and scope["type"] == "http":
            return await self.login_route(scope, receive, send, headers, client)
        if path in OPEN_FROM_LOOPBACK and client in LOOPBACK_CLIENTS:
            return await self.app(scope, receive, send)
        if self.login.session_ok(self.session_of(headers)):
            return await self.app(scope, receive, send)
        return await self.authenticate(scope, receive, send, headers, client)

    # ------------------------------------------------------------------ checks
    def origin_problem(self, headers: dict[str, str]) -> str:
        """Why a request's Host or Origin is not this board's ('' when both are allowed)."""
        host = host_name(headers.get("host", ""))
        if host not in self.hosts:
            return (f"Host '{headers.get('host', '')}' is not one this board answers to (DNS rebinding is refused). "
                    f"Fix: open the board as http://127.0.0.1:{self.port}/, or start it with --allowed-host NAME")
        origin = headers.get("origin")
        if origin is None:
            return ""
        parts = urlsplit(origin)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or (parts.hostname or "").lower() not in self.hosts or port != self.port:
            return f"a request from the page '{origin}' is refused: only the board's own pages may call it"
        return ""

    def session_of(self, headers: dict[str, str]) -> str | None:
        cookies = SimpleCookie()
        try:
            cookies.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header: no session
            return None
        morsel = cookies.get(self.cookie)
        return morsel.value if morsel is not None else None

    # ------------------------------------------------------------------ login
    async def authenticate(self, scope, receive, send, headers, client):
        """A request without a session: `?token=` (GET) or `Authorization: token ...`; else the login page / 401."""
        wait = self.login.locked(client)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        given = query.get("token", [None])[-1]
        auth = headers.get("authorization", "")
        scheme, _, header_token = auth.partition(" ")
        if given is None and scheme.lower() in ("token", "bearer"):
            given = header_token.strip()
        if given is not None:
            if wait:
                return await self.respond(scope, receive, send, 429, self.locked_text(wait), retry=wait)
            if self.login.secret_ok(given, token_only=True):
                if "token" in query and scope["type"] == "http" and scope.get("method") == "GET":
                    rest = urlencode([(k, v) for k, vs in query.items() if k != "token" for v in vs], doseq=True)
                    return await self.redirect(send, scope["path"] + (f"?{rest}" if rest else ""),
                                               self.login.open_session())
                return await self.app(scope, receive, send)  # a script's header (or a websocket): this request only
            self.login.failed(client)
            return await self.respond(scope, receive, send, 401, "wrong token")
        if scope["type"] == "http" and scope.get("method") == "GET" and "text/html" in headers.get("accept", ""):
            target = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
            return await self.redirect(send, "/login?" + urlencode({"next": target}))
        return await self.respond(scope, receive, send, 401, "login required: open the URL the board printed at "
                                  "start (.../?token=...), or send `Authorization: token <token>`")

    async def login_route(self, scope, receive, send, headers, client):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        next_path = safe_next(query.get("next", ["/"])[-1])
        if scope.get("method") != "POST":
            return await self.page(send, 200, "", next_path)
        wait = self.login.locked(client)
        if wait:
            return await self.page(send, 429, self.locked_text(wait), next_path, retry=wait)
        body = await read_body(receive, LOGIN_BODY_LIMIT)
        form = parse_qs(body.decode("utf-8", errors="replace")) if body is not None else {}
        next_path = safe_next(form.get("next", [next_path])[-1])
        if body is not None and self.login.secret_ok(form.get("secret", [""])[-1]):
            return await self.redirect(send, next_path, self.login.open_session())
        self.login.failed(client)
        return await self.page(send, 401, "wrong token or password", next_path)

    def locked_text(self, wait: float) -> str:
        return (f"{LOGIN_FAILURES} wrong tries from this address: wait {wait:.0f} s before the next "
                "(the token is printed in the board's console)")

    # ------------------------------------------------------------------ answers
    def set_cookie(self, session: str) -> bytes:
        secure = "; Secure" if self.secure else ""
        return (f"{self.cookie}={session}; Path=/; HttpOnly; SameSite=Strict; Max-Age={int(SESSION_S)}"
                f"{secure}").encode()

    async def redirect(self, send, location: str, session: str | None = None):
        headers = [(b"location", location.encode("latin-1", errors="replace")), (b"content-length", b"0")]
        if session is not None:
            headers.append((b"set-cookie", self.set_cookie(session)))
        await send({"type": "http.response.start", "status": 303, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def page(self, send, status: int, message: str, next_path: str, retry: float = 0):
        body = LOGIN_PAGE.format(env=PASSWORD_ENV, message=html.escape(message),
                                 next=html.escape(next_path, quote=True)).encode()
        await self.send_body(send, status, body, b"text/html; charset=utf-8", retry)

    async def respond(self, scope, receive, send, status: int, message: str, retry: float = 0):
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.send_body(send, status, json.dumps({"detail": message}).encode(), b"application/json", retry)

    async def send_body(self, send, status: int, body: bytes, kind: bytes, retry: float = 0):
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode()),
                   (b"cache-control", b"no-store")]
        if retry:
            headers.append((b"retry-after", str(int(retry) + 1).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def safe_next(value: str) -> str:
    """Where to go after the login: a path of this board only (no `//host`, no scheme)."""
    value = value or "/"
    if not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return quote(value, safe="/?&=%:+,;-._~")


async def read_body(receive, limit: int) -> bytes | None:
    """The request body, or None when it is larger than `limit` bytes."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body"):
            return body
