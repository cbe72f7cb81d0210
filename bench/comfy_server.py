"""A real ComfyUI server on the CPU, driven over HTTP (POST /prompt in API format, GET /history): started in a base
directory (its custom nodes, models and outputs) with an in-memory database, polled until it answers, stopped with
SIGTERM. Used by `tightrope bench host-memory` (bench/host_memory_server.py) and the integration tests
(tests/integration/conftest.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path


class PromptFailed(RuntimeError):
    """ComfyUI refused a prompt, or the prompt ended other than expected, or the server exited while it ran."""


def comfy_python(comfy_dir: str) -> str:
    """ComfyUI's python: COMFYUI_PYTHON, default <comfy_dir>/../venv/bin/python."""
    py = os.environ.get("COMFYUI_PYTHON") or os.path.join(comfy_dir, "..", "venv", "bin", "python")
    if not os.path.exists(py):
        raise RuntimeError(f"ComfyUI's python not found at {py}: set COMFYUI_PYTHON")
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ComfyUI server process, launched when made (`wait_ready()` waits until it answers); `stop()` ends it."""

    def __init__(self, comfy_dir: str, base: Path, python: str | None = None):
        self.base = base
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python or comfy_python(comfy_dir), os.path.join(comfy_dir, "main.py"), "--cpu", "--listen",
               "127.0.0.1", "--port", str(self.port), "--disable-auto-launch", "--database-url", "sqlite:///:memory:",
               "--base-directory", str(base)]
        self.log_path = base / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=comfy_dir, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode} while starting:\n{self.log()[-4000:]}")
            try:
                self.get("/system_stats", timeout=2)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
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
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

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

    def wait(self, prompt_id: str, timeout: float = 1800, expect: str = "success") -> dict:
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

    def run(self, prompt: dict, timeout: float = 1800) -> dict:
        return self.wait(self.queue(prompt), timeout)
