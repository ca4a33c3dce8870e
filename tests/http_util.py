"""Raw HTTP/1.1 over one socket, for tests that must see exactly what the server sends
(and that the next request on the same keep-alive connection still works)."""

from __future__ import annotations

import json
import socket


class RawConnection:
    def __init__(self, url: str, timeout_s: float = 60.0):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple:
        head = [f"{method} {path} HTTP/1.1", "Host: test"]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}")
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        self.send_raw(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        return self.read_response()

    def post_json(self, path: str, obj, headers: dict | None = None) -> tuple:
        return self.request("POST", path, json.dumps(obj).encode(), headers)

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 16)
        self.buf += chunk
        return bool(chunk)

    def read_response(self) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one response with Content-Length or chunked body."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError(f"connection closed before a response head (got {self.buf[:200]!r})")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                if not self._fill():
                    raise ConnectionError("connection closed inside a body")
            body, self.buf = self.buf[:n], self.buf[n:]
            return status, headers, body
        body = b""
        while True:  # chunked
            while b"\r\n" not in self.buf:
                if not self._fill():
                    raise ConnectionError("connection closed inside a chunked body")
            size_line, self.buf = self.buf.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(self.buf) < size + 2:
                if not self._fill():
                    raise ConnectionError("connection closed inside a chunk")
            body += self.buf[:size]
            self.buf = self.buf[size + 2:]
            if size == 0:
                return status, headers, body

    def closed_by_peer(self) -> bool:
        """True once the server has closed this connection (reads EOF)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, socket.timeout):
            return False


def sse_events(body: bytes) -> list:
    """The data payloads of an SSE body: dicts, and the string "[DONE]"."""
    out = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
