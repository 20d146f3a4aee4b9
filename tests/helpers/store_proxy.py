"""A loopback TCP proxy in front of an object store's server (S3, GCS, Azure), shared by the fsspec
tests (tests/integration/test_fsspec_source.py and test_fsspec_backends.py): it records each request,
can refuse or drop one, and calls a hook before the first download."""
from __future__ import annotations

import socket
import threading


class Proxy:
    """Forwards loopback TCP to a server; records each request's line and headers; answers a request
    that `refuse` matches with `refusal`, or drops its connection when `refusal` is None (the response
    never arrives); calls `before_download` once with the request line of the first download it sees."""

    def __init__(self, target: tuple[str, int], is_download):
        self.target, self.is_download = target, is_download
        self.requests: list[str] = []
        self.refuse = None  # a predicate on the request head
        self.refusal: bytes | None = b""
        self.before_download = None
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def downloads(self) -> list[str]:
        return [r.split("\r\n", 1)[0] for r in self.requests if self.is_download(r.split("\r\n", 1)[0])]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                if upstream and data[:4] in (b"GET ", b"PUT ", b"HEAD", b"POST", b"DELE"):
                    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
                    self.requests.append(head)
                    if self.refuse is not None and self.refuse(head):
                        if self.refusal is None:
                            break
                        src.sendall(self.refusal)
                        continue
                    line = head.split("\r\n", 1)[0]
                    if self.is_download(line) and self.before_download is not None:
                        hook, self.before_download = self.before_download, None
                        hook(line)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()


def http_refusal(status: str, body: str, content_type: str) -> bytes:
    """A complete HTTP response, as the store would send it."""
    data = body.encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
