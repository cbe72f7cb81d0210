"""A real ComfyUI server for the integration tests: started on the CPU in a temporary base directory with this repo as
its only custom node, driven over HTTP (POST /prompt in API format, GET /history) and its websocket (/ws)."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path


class PromptFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, python: str, comfy_dir: str, base: Path):
        self.python, self.comfy_dir, self.base = python, comfy_dir, base
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "server.log"
        self.proc: subprocess.Popen | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def start(self, timeout: float = 180) -> None:
        cmd = [self.python, os.path.join(self.comfy_dir, "main.py"), "--cpu", "--listen", "127.0.0.1",
               "--port", str(self.port), "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
               "--base-directory", str(self.base)]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} while starting:\n{self.log()}")
            try:
                self.get("/system_stats", timeout=2)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def alive(self) -> bool:
        try:
            return self.proc.poll() is None and "system" in self.get("/system_stats", timeout=5)
        except (OSError, urllib.error.URLError):
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # -- HTTP -------------------------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, data: dict, timeout: float = 30):
        req = urllib.request.Request(self.url + path, data=json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            raise PromptFailed(f"POST {path} -> {e.code}: {e.read().decode(errors='replace')}") from None
        return json.loads(body) if body.strip() else None

    def queue(self, prompt: dict, client_id: str | None = None) -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": client_id or uuid.uuid4().hex})["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600, expect: str = "success") -> dict:
        """The prompt's /history entry once it finished; raises unless it ended with `expect` (success/error)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                if status.get("status_str") != expect:
                    raise PromptFailed(f"prompt ended {status.get('status_str')!r}, expected {expect!r}: "
                                       f"{json.dumps(status.get('messages'), indent=1)[-4000:]}\n"
                                       f"server log tail:\n{self.log()[-4000:]}")
                return entry
            if self.proc.poll() is not None:
                raise PromptFailed(f"ComfyUI exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            time.sleep(0.25)
        raise PromptFailed(f"prompt {prompt_id} did not finish within {timeout} s:\n{self.log()[-4000:]}")

    def run(self, prompt: dict, timeout: float = 600) -> dict:
        return self.wait(self.queue(prompt), timeout)


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

    def __init__(self, server: ComfyServer, client_id: str):
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
