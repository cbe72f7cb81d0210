# Two commands for a fresh machine:  `make demo` (train the embedded default)  and  `make test`.
PY ?= python3

.PHONY: install demo test bench-quick gpu-check gpu-bench
install:
	@# torch belongs to the user's ComfyUI; a bare dev/CI machine gets the CPU build (never upgrades an existing torch)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) -m tightrope run workflows/demo.json --output-dir output

# one worker per core (pytest-xdist), each test file in one worker: its module fixtures run once
test: install
	$(PY) -m pytest -n auto --dist loadfile

bench-quick: install
	$(PY) -m tightrope bench --quick

# On a GPU machine (each under 9 minutes on one H100; results in $(GPU_CHECK_OUT), default
# benchmarks/results/<device>-<date>/; without CUDA: one line, exit 0). Exit 1 if a correctness check fails.
GPU_CHECK_OUT ?=
gpu-check: install
	$(PY) -m tightrope bench gpu-check $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT))

gpu-bench: install
	$(PY) -m tightrope bench gpu-bench $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT))
