"""The pack loads in a real ComfyUI server: every node is listed, and the log shows no import error for it."""
from tightrope import NODE_CLASS_MAPPINGS


def test_every_node_is_listed(comfy_server):
    info = comfy_server.get("/object_info")
    missing = sorted(set(NODE_CLASS_MAPPINGS) - set(info))
    assert not missing, f"/object_info lacks {missing}; server log:\n{comfy_server.log()[-3000:]}"
    for name, cls in NODE_CLASS_MAPPINGS.items():
        assert info[name]["category"] == cls.CATEGORY and info[name]["output"] == list(cls.RETURN_TYPES)


def test_no_import_error(comfy_server):
    """At start-up (the log before the server says where its GUI is): later prompts of the session may fail on
    purpose, and ComfyUI logs their tracebacks."""
    log = comfy_server.log().split("To see the GUI go to")[0]
    lines = [ln for ln in log.splitlines() if "tightrope" in ln.lower()]
    assert not [ln for ln in lines if "IMPORT FAILED" in ln or "Cannot import" in ln], "\n".join(lines)
    assert "Traceback" not in log, log[-3000:]
    assert any("custom_nodes" in ln and "tightrope" in ln for ln in lines), \
        f"the server log does not list the pack among the imported custom nodes:\n{log[-3000:]}"
