"""Websocket clients for the integration tests: ComfyUI's /ws (the server is tightrope.bench.comfy_server.Server,
started by conftest.py) and Chromium's DevTools protocol (test_frontend.py)."""
from __future__ import annotations

import base64
import json
import os
import socket
import threading

from tightrope.bench.comfy_server import Server


class WebSocketConnection:
    """A minimal RFC 6455 client (stdlib only): text frames out (masked), whole messages in (fragments joined).
    Used for ComfyUI's /ws (WebSocket below) and for Chromium's DevTools protocol (test_frontend.py)."""

    def __init__(self, port: int, path: str, timeout: float = 30):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                           f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake failed: {head!r}")

    def _exact(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(min(n - len(data), 1 << 20))
            if not chunk:
                raise ConnectionError("websocket closed")
            data += chunk
        return bytes(data)

    def recv(self) -> tuple[int, bytes]:
        """The next message as (opcode, payload): 1 text, 2 binary, 8 close; pings are answered, not returned."""
        opcode, parts = None, []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(self._exact(2), "big")
            elif n == 127:
                n = int.from_bytes(self._exact(8), "big")
            mask = self._exact(4) if b1 & 0x80 else None
            payload = self._exact(n)
            if mask:
                payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
            op = b0 & 0x0F
            if op == 9:  # ping
                self._send(0xA, payload)
                continue
            if op >= 8:
                if op == 8:
                    return 8, payload
                continue  # pong
            if op != 0:
                opcode = op
            parts.append(payload)
            if b0 & 0x80:  # FIN
                return opcode, b"".join(parts)

    def _send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
        mask = os.urandom(4)
        masked = (int.from_bytes(payload, "little") ^ int.from_bytes(mask * (n // 4 + 1), "little")
                  & ((1 << (8 * n)) - 1)).to_bytes(n, "little") if n else b""
        self.sock.sendall(head + mask + masked)

    def send_text(self, text: str) -> None:
        self._send(1, text.encode())

    def close(self) -> None:
        try:
            self._send(8, b"")
        except OSError:
            pass
        self.sock.close()


class WebSocket(WebSocketConnection):
    """ComfyUI's /ws for one client id: collects the JSON text messages in a thread."""

    def __init__(self, server: Server, client_id: str):
        self.messages: list[dict] = []
        super().__init__(server.port, f"/ws?clientId={client_id}")
        self.sock.settimeout(None)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                opcode, payload = self.recv()
                if opcode == 8:
                    return
                if opcode == 1:
                    self.messages.append(json.loads(payload))
        except (OSError, ConnectionError, ValueError):
            return

    def of_type(self, kind: str, prompt_id: str | None = None) -> list[dict]:
        return [m["data"] for m in list(self.messages) if m.get("type") == kind
                and (prompt_id is None or m.get("data", {}).get("prompt_id") == prompt_id)]
