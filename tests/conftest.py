import os
import sys

# test helpers (small models, comparison utilities) live in tests/helpers and are imported by module name
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

# pytest-xdist (`make test` runs the suite in one worker per core): each worker's torch gets its share of the cores,
# so the workers do not oversubscribe them (the golden curve's tolerance covers thread counts: test_golden_losses)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# TIGHTROPE_BACKWARD_THREAD=1: every backward of the run runs on a thread of its own, as the autograd engine runs a
# CUDA backward on its device thread (tests/helpers/device_thread.py); the CPU runs it on the caller's thread
if os.environ.get("TIGHTROPE_BACKWARD_THREAD"):
    import pytest

    @pytest.fixture(autouse=True)
    def _backward_on_another_thread(monkeypatch):
        from device_thread import backward_on_another_thread
        yield backward_on_another_thread(monkeypatch)
