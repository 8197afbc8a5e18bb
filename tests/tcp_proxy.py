"""A TCP proxy on 127.0.0.1 that a test controls: it forwards every connection to a target (the local S3 server of
the object-store tests) until :meth:`TcpProxy.freeze` holds every byte in both directions (a frozen store or a
hung mount: connections stay open, nothing answers) and :meth:`TcpProxy.thaw` lets them through again; ``delay``
slows each forwarded chunk (a slow store).  Loopback only."""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    """``TcpProxy(port)``: listens on a free port of 127.0.0.1 (``.port``) and forwards to ``127.0.0.1:port``."""

    def __init__(self, target_port: int, delay: float = 0.0):
        self.target = ("127.0.0.1", int(target_port))
        self.delay = float(delay)
        self._open = threading.Event()
        self._open.set()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stopped = False
        self._conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def freeze(self) -> None:
        """Hold every byte from now on (connections stay open)."""
        self._open.clear()

    def thaw(self) -> None:
        """Forward again (held bytes go through)."""
        self._open.set()

    def close(self) -> None:
        self._stopped = True
        self._open.set()
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._open.wait()
                if self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
