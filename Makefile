# Two commands for a fresh machine:  `make demo` (train the embedded default)  and  `make test`.
PY ?= python3

.PHONY: install demo test bench-quick
install:
	@# torch belongs to the user's ComfyUI; a bare dev/CI machine gets the CPU build (never upgrades an existing torch)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -m pip install -q -e ".[test]"

demo: install
	$(PY) -m tightrope run workflows/demo.json --output-dir output

test: install
	$(PY) -m pytest

bench-quick: install
	$(PY) -m tightrope bench --quick
