"""The shipped workflows in ComfyUI's real frontend: headless Chromium, driven over the DevTools protocol (stdlib
websocket client from comfy_websocket), opens the fixture server's page, loads each workflows/*.json with
app.loadGraphData and checks that every node type is known (no missing-nodes dialog) and that each Tightrope node's
widgets hold the saved widgets_values (not reset or shifted; combos hold one of their options), and that no node
overlaps another as the frontend sizes them; demo_features.json is also queued from the frontend and run. A PNG of
each loaded graph goes to $TIGHTROPE_ARTIFACTS (default: a pytest tmp dir); the paths are printed.

Skipped, with the reason printed, without COMFYUI_DIR or without a Chromium binary (CHROMIUM, or chromium /
chromium-browser / google-chrome on PATH; Debian: apt-get install chromium).
"""
from __future__ import annotations

import base64
import itertools
import json
import math
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from comfy_env import REPO
from comfy_websocket import WebSocketConnection

from tightrope.bench.comfy_server import free_port

WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
VIEWPORT = (1920, 1080)


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


class CDP:
    """One page target of a headless Chromium, over the DevTools protocol."""

    def __init__(self, binary: str, user_data_dir: Path):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={self.port}",
             f"--user-data-dir={user_data_dir}", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=open(user_data_dir / "chromium.log", "wb"))
        self.ids = itertools.count(1)
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=2) as r:
                    pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
                if pages:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"Chromium did not start:\n{(user_data_dir / 'chromium.log').read_text()[-3000:]}")
            time.sleep(0.25)
        self.ws = WebSocketConnection(self.port, pages[0]["webSocketDebuggerUrl"].split(str(self.port), 1)[1],
                                      timeout=120)
        self.console: list[str] = []

    def send(self, method: str, **params):
        msg_id = next(self.ids)
        self.ws.send_text(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            opcode, payload = self.ws.recv()
            if opcode == 8:
                raise ConnectionError("DevTools websocket closed")
            msg = json.loads(payload)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            if msg.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:500])
            elif msg.get("method") == "Runtime.consoleAPICalled" and msg["params"]["type"] in ("error", "warning"):
                self.console.append(f"{msg['params']['type']}: " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in msg["params"]["args"])[:500])

    def js(self, expression: str):
        """Evaluate an expression (promises awaited) and return its JSON value; page exceptions raise."""
        res = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"JS failed: {json.dumps(res['exceptionDetails'])[:2000]}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 90, what: str = ""):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what or expression}; page console:\n" +
                             "\n".join(self.console[-30:]))

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (OSError, ConnectionError, RuntimeError):
            pass
        self.ws.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    path = Path(os.environ.get("TIGHTROPE_ARTIFACTS") or tmp_path_factory.mktemp("frontend_artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def page(request, tmp_path_factory):
    binary = _chromium()
    if binary is None:  # checked before the server starts
        reason = "no Chromium binary (set CHROMIUM or install chromium, e.g. apt-get install chromium)"
        print(f"\nskipping the frontend tests: {reason}")
        pytest.skip(reason)
    comfy_server = request.getfixturevalue("comfy_server")
    # a fresh user: skip the first-run templates browser; missing model files are expected (only node types and
    # widgets are checked here), the missing-nodes warning stays on
    comfy_server.post("/settings", {"Comfy.TutorialCompleted": True,
                                    "Comfy.Workflow.ShowMissingModelsWarning": False,
                                    "Comfy.Workflow.ShowMissingNodesWarning": True})
    cdp = CDP(binary, tmp_path_factory.mktemp("chromium"))
    try:
        cdp.send("Runtime.enable")
        cdp.send("Page.enable")
        cdp.send("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1], deviceScaleFactor=1,
                 mobile=False)
        cdp.send("Page.navigate", url=comfy_server.url + "/")
        cdp.wait_for("!!(window.app && window.app.graph && window.app.canvas && window.LiteGraph && "
                     "Object.keys(window.LiteGraph.registered_node_types).some(t => t.startsWith('Tightrope')))",
                     what="the ComfyUI frontend with Tightrope's node types")
        yield cdp
    finally:
        cdp.close()


# Everything read back after loading: node types against LiteGraph's registry, each node's widgets and what the
# frontend would save for them, and any dialog left open (the missing-nodes warning is one).
INSPECT = """(() => {
  const known = window.LiteGraph.registered_node_types;
  const visible = el => !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length);
  return {
    nodes: window.app.graph._nodes.map(n => ({
      id: n.id, id_type: typeof n.id, type: n.type, known: n.type in known, has_errors: !!n.has_errors,
      widgets: (n.widgets || []).map(w => ({name: w.name, type: w.type, value: w.value,
                                             values: Array.isArray(w.options?.values) ? w.options.values : null})),
      saved: n.serialize().widgets_values ?? null,
      box: Array.from(n.getBounding ? n.getBounding() : [n.pos[0], n.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT,
                                                       n.size[0], n.size[1] + window.LiteGraph.NODE_TITLE_HEIGHT]),
    })),
    dialogs: [...document.querySelectorAll('.p-dialog, [role=dialog]')].filter(visible)
               .map(d => d.innerText.slice(0, 400)),
  };
})()"""


# the whole graph in view for the screenshot (the frontend's "fit view" command, else LiteGraph's own)
FIT_VIEW = """(async () => {
  const canvas = window.app.canvas;
  try { await window.app.extensionManager.command.execute('Comfy.Canvas.FitView'); }
  catch (e) { canvas.fitViewToSelectionAnimated?.({duration: 0}); }
  canvas.setDirty(true, true);
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return true;
})()"""


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_workflow_loads_in_the_frontend(page, workflow, artifacts):
    data = json.loads(workflow.read_text())
    page.console.clear()
    page.js(f"window.app.loadGraphData({json.dumps(data)}).then(() => true)")
    page.js("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")
    time.sleep(1.0)  # dialogs open asynchronously after loading
    got = page.js(INSPECT)
    shot = artifacts / f"frontend_{workflow.stem}.png"
    page.js(FIT_VIEW)
    time.sleep(0.5)
    page.screenshot(shot)
    print(f"\nscreenshot of {workflow.name}: {shot}")

    problems = []
    by_id = {str(n["id"]): n for n in got["nodes"]}  # the frontend may hold ids as strings
    if sorted(by_id) != sorted(str(n["id"]) for n in data["nodes"]):
        problems.append(f"node ids in the graph {sorted(by_id)} != saved {sorted(n['id'] for n in data['nodes'])}")
    for node in got["nodes"]:
        # has_errors alone also marks core loaders whose model files are absent here: only types are checked
        if not node["known"]:
            problems.append(f"node {node['id']}: type {node['type']!r} unknown to the frontend")
        elif node["has_errors"] and node["type"].startswith("Tightrope"):
            problems.append(f"node {node['id']}: {node['type']} flagged has_errors by the frontend")
    for a, b in itertools.combinations(got["nodes"], 2):  # as the frontend sized them: none hides another
        (ax, ay, aw, ah), (bx, by, bw, bh) = a["box"], b["box"]
        if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
            problems.append(f"nodes {a['id']} {a['type']} {a['box']} and {b['id']} {b['type']} {b['box']} overlap")
    if got["dialogs"]:
        problems.append(f"dialog(s) open after loading: {got['dialogs']}")
    for saved in data["nodes"]:
        if saved["type"].startswith("Tightrope") and str(saved["id"]) in by_id:
            node = by_id[str(saved["id"])]
            want = saved["widgets_values"]
            values = [w["value"] for w in node["widgets"]]
            if len(values) != len(want) or not all(map(_same, values, want)):
                problems.append(f"node {saved['id']} {saved['type']}: widget values "
                                f"{[(w['name'], w['value']) for w in node['widgets']]} != saved {want}")
            if node["saved"] is None or len(node["saved"]) != len(want) or not all(map(_same, node["saved"], want)):
                problems.append(f"node {saved['id']} {saved['type']}: re-saved widgets_values {node['saved']} "
                                f"!= saved {want}")
            for w in node["widgets"]:
                if w["values"] is not None and w["value"] not in w["values"]:
                    problems.append(f"node {saved['id']} {saved['type']}: combo {w['name']}={w['value']!r} "
                                    f"not in its options {w['values']}")
    assert not problems, "\n".join(problems + ["page console:"] + page.console[-30:] + [f"screenshot: {shot}"])


def test_demo_features_queues_from_the_frontend_and_runs(page, comfy_server):
    """workflows/demo_features.json as the frontend turns it into a prompt (app.graphToPrompt, what Queue sends), run
    by the server: the LoKr file and its _ema twin are written to the loras folder, the plots are shown."""
    data = json.loads((REPO / "workflows" / "demo_features.json").read_text())
    page.js(f"window.app.loadGraphData({json.dumps(data)}).then(() => true)")
    prompt = page.js("window.app.graphToPrompt().then(p => p.output)")
    assert {node["class_type"] for node in prompt.values()} == {n["type"] for n in data["nodes"]}
    outputs = comfy_server.run(prompt, timeout=580)["outputs"]
    save = next(node_id for node_id, node in prompt.items() if node["class_type"] == "TightropeSaveLora")
    paths = [Path(p) for p in outputs[save]["text"]]
    assert [p.name for p in paths] == ["demo_features_lokr_00001_.safetensors",
                                       "demo_features_lokr_ema_00001_.safetensors"], paths
    loras = (comfy_server.base / "models" / "loras" / "tightrope").resolve()
    assert all(p.exists() and p.resolve().parent == loras for p in paths), paths
    plots = next(node_id for node_id, node in prompt.items() if node["class_type"] == "TightropePlots")
    assert [image["filename"] for image in outputs[plots]["images"]] == ["demo_features_loss_00001_.png",
                                                                          "demo_features_memory_00001_.png"]
