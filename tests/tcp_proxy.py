"""A TCP proxy on loopback in front of a real server, that can break a connection at the
worst moments: after the server ran a statement but before its answer reaches the client
(an ambiguous commit), before the statement reaches the server, or by refusing new
connections. Between client and server everything else passes through unchanged."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from typing import Literal

Cut = Literal["answer", "request"]


class TcpProxy:
    """Listens on ``127.0.0.1:port`` and forwards each connection to ``upstream``.

    ``cut_next(...)``: the next data a client sends is forwarded (``"answer"``: the server
    runs it, then its answer is dropped) or dropped (``"request"``), and that connection is
    closed on both sides. ``refuse``: new connections are closed at once."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._cut: Cut | None = None
        self._armed: set[int] = set()  # connections whose next answer is lost
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.cuts = 0
        self.refuse = False
        self._closed = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    def cut_next(self, how: Cut) -> None:
        with self._lock:
            self._cut = how

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._pairs.append((client, server))
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        me = id(client)
        with selectors.DefaultSelector() as sel:
            sel.register(client, selectors.EVENT_READ, server)
            sel.register(server, selectors.EVENT_READ, client)
            try:
                while True:
                    for key, _ in sel.select():
                        source: socket.socket = key.fileobj  # type: ignore[assignment]
                        data = source.recv(65536)
                        if not data:
                            return
                        with self._lock:
                            if source is client and self._cut is not None:
                                how, self._cut = self._cut, None
                                if how == "request":
                                    self.cuts += 1
                                    return
                                self._armed.add(me)
                            elif source is server and me in self._armed:
                                self._armed.discard(me)
                                self.cuts += 1
                                return
                        key.data.sendall(data)
            except OSError:
                return
            finally:
                for sock in (client, server):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.close()

    def cut_all(self) -> None:
        """Break every connection open now (as a server restart does)."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut_all()
