"""Running the server: the engine, the app and uvicorn on a socket bound here (so that port 0
gives a free port, and the line printed names the real one).

SIGTERM or Ctrl-C: uvicorn stops accepting connections; the requests already accepted run on
for `grace` seconds, then end (a stream with an error event, a plain request with 503); the
process then exits with status 0.
"""
from __future__ import annotations

import signal
import socket
import sys

from .._extras import require
from ..errors import XLSTMKitError
from .app import App
from .engine import Engine


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][:3]
    # asyncio turns Nagle's algorithm off only on sockets whose proto is TCP, and a bare
    # socket(family, SOCK_STREAM) has proto 0. With it on, a streamed event waits until the
    # client acknowledges the write before it (the headers, the token before), which clients
    # delay by 40 ms or more: the first token came that much late. (Linux also passes the
    # listening socket's TCP_NODELAY on to the connections it accepts.)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(engine: Engine, app: App, host: str, port: int, grace: float, prog: str = "xlstm-kit serve") -> int:
    """Serve until SIGTERM / SIGINT; the engine must be started. Returns the exit status."""
    uvicorn = require("uvicorn", prog)
    try:
        sock = _bind(host, port)
    except OSError as e:
        engine.close(0)
        raise XLSTMKitError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.close(grace)  # the accepted requests get `grace` seconds, then end
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app.app, log_level="warning", access_log=False, lifespan="on", interface="asgi3",
                            ws="none", timeout_graceful_shutdown=int(grace) + 5)
    server = Server(config)
    # Until uvicorn has its own handlers in place, a signal is only noted and handed to it once
    # the app runs; uvicorn re-raises the signal it stopped on when done, with the handlers it
    # found (these), so that a clean shutdown ends with status 0 instead of a death by signal.
    early: list[int] = []
    previous = {s: signal.signal(s, lambda sig, frame: early.append(sig)) for s in (signal.SIGTERM, signal.SIGINT)}

    def started() -> None:
        print(f"{prog}: {app.name} on {url(sock)} (max batch {engine.max_batch}, {engine.device.type}); "
              f"SIGTERM or Ctrl-C stops", file=sys.stderr, flush=True)
        for sig in early:
            server.handle_exit(sig, None)

    app.on_start = started
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        engine.close(0)
        engine.join(timeout=grace + 5)
    done = sum(engine.stats.finished.values())
    print(f"{prog}: stopped after {done} request{'s' if done != 1 else ''}", file=sys.stderr, flush=True)
    return 0
