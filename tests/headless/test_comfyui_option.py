"""Choosing ComfyUI for a headless run (--comfyui DIR, or $COMFYUI_DIR only when the workflow needs ComfyUI's nodes),
and the errors when it cannot be used. Runs without ComfyUI (tests/integration/test_headless_comfyui.py runs with it)."""
import json

import pytest

from tightrope import cli
from tightrope.headless.comfyui_library import comfyui_dir

TIGHTROPE_ONLY = {"1": {"class_type": "TightropeLoraSetup", "inputs": {}}}
WITH_CORE = {**TIGHTROPE_ONLY, "2": {"class_type": "KSampler", "inputs": {}}}
MAPPINGS = {"TightropeLoraSetup": object}


def test_the_option_wins_and_the_environment_is_used_only_for_core_nodes():
    env = {"COMFYUI_DIR": "/env/ComfyUI"}
    assert comfyui_dir("/opt/ComfyUI", TIGHTROPE_ONLY, MAPPINGS, env) == "/opt/ComfyUI"
    assert comfyui_dir(None, TIGHTROPE_ONLY, MAPPINGS, env) is None  # runs as without ComfyUI
    assert comfyui_dir(None, WITH_CORE, MAPPINGS, env) == "/env/ComfyUI"
    assert comfyui_dir(None, WITH_CORE, MAPPINGS, {}) is None


def test_ui_format_counts_only_nodes_that_run():
    ui = {"nodes": [{"id": 1, "type": "TightropeLoraSetup"}, {"id": 2, "type": "KSampler", "mode": 2},
                    {"id": 3, "type": "Note"}, {"id": 4, "type": "Reroute"}], "links": []}
    assert comfyui_dir(None, ui, MAPPINGS, {"COMFYUI_DIR": "/c"}) is None  # KSampler is muted
    ui["nodes"][1]["mode"] = 0
    assert comfyui_dir(None, ui, MAPPINGS, {"COMFYUI_DIR": "/c"}) == "/c"


def test_missing_comfyui_dir_exits_2_naming_the_option(tmp_path, capsys):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(WITH_CORE))
    assert cli.main(["run", str(path), "--comfyui", str(tmp_path / "nope"), "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: ComfyUI dir '{tmp_path / 'nope'}' does not exist: pass --comfyui DIR (or set COMFYUI_DIR)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("option, message", [
    ("--models-dir", "--models-dir is where ComfyUI's loaders look for model files: it needs ComfyUI"),
    ("--custom-node", "--custom-node loads a ComfyUI custom node pack: it needs ComfyUI")])
def test_comfyui_options_without_comfyui_exit_2(option, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(TIGHTROPE_ONLY))
    assert cli.main(["run", str(path), option, str(tmp_path), "--output-dir", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_a_comfyui_whose_requirements_are_missing_exits_2_with_the_install_command(tmp_path, capsys):
    """ComfyUI imported into a python without its requirements (ModuleNotFoundError deep in its imports) is one line
    naming the fix, not a traceback. The fake ComfyUI's half-imported modules and its sys.path entry are removed."""
    import sys
    comfy = tmp_path / "ComfyUI"
    (comfy / "comfy").mkdir(parents=True)
    for name in ("nodes.py", "folder_paths.py", "execution.py", "comfy/__init__.py"):
        (comfy / name).write_text("")
    (comfy / "comfy" / "options.py").write_text("import comfy_requirement_not_installed\n")
    path = tmp_path / "w.json"
    path.write_text(json.dumps(WITH_CORE))
    before, path_before = set(sys.modules), list(sys.path)
    try:
        code = cli.main(["run", str(path), "--comfyui", str(comfy), "--output-dir", str(tmp_path / "o")])
    finally:
        for name in set(sys.modules) - before:  # the fake `comfy` package must not shadow a real one later
            if name == "comfy" or name.startswith("comfy."):
                del sys.modules[name]
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and sys.path == path_before, err
    assert (f"the ComfyUI at {comfy} cannot be imported in this python (No module named "
            f"'comfy_requirement_not_installed'): run tightrope with ComfyUI's python, or install ComfyUI's "
            f"requirements into this one (pip install -r {comfy}/requirements.txt)") in err


def test_an_empty_models_dir_is_refused_not_taken_for_the_working_directory():
    """`--models-dir "$MODELS"` with MODELS unset made ComfyUI look for models in the working directory."""
    from tightrope.headless.graph import WorkflowError
    with pytest.raises(WorkflowError, match=r"^--models-dir '' is empty: pass the folder that holds diffusion_models/"):
        cli._comfyui_folders(object(), "")
