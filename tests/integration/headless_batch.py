"""Several `tightrope run` command lines in one process of ComfyUI's python, so ComfyUI is imported once for all of
them (loading it takes tens of seconds on 2 cores); each main() call stands alone, as the CLI promises.

    python headless_batch.py RUNS.json      RUNS.json: [{"argv": [...], "log": path, "ui_from": prompt-or-null}, ...]

Each run's stdout and stderr (the file descriptors, so ComfyUI's logging and tqdm too) go to its "log" file; a run
with "ui_from" first writes that API prompt as a UI-format workflow to argv[1] (with the real node classes). The exit
codes are written to RUNS.json.codes.
"""
import json
import os
import sys


def _captured(log_path: str, fn) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            return fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _write_ui(prompt: dict, path: str) -> None:
    from tightrope import cli
    from tightrope.headless.comfyui_library import load_comfyui
    from ui_graph import to_ui_workflow
    mappings = cli.load_node_mappings(load_comfyui(os.environ["COMFYUI_DIR"]))
    with open(path, "w") as handle:
        json.dump(to_ui_workflow(prompt, mappings), handle, indent=1)


def main(runs_path: str) -> None:
    from tightrope import cli
    with open(runs_path) as handle:
        runs = json.load(handle)
    codes = []
    for run in runs:
        if run.get("ui_from"):
            _write_ui(run["ui_from"], run["argv"][1])
        codes.append(_captured(run["log"], lambda: cli.main(run["argv"])))
    with open(runs_path + ".codes", "w") as handle:
        json.dump(codes, handle)


if __name__ == "__main__":
    main(sys.argv[1])  # (this folder is sys.path[0]: ui_graph imports)
