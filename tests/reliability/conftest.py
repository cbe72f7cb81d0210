import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reliability_kit lives beside the tests (no packages: importlib mode)

from tightrope.nodes import host  # noqa: E402


@pytest.fixture
def out(tmp_path):
    """Headless output (= loras) folder for node runs; resume off before and after."""
    host.set_headless_output_dir(tmp_path / "out")
    host.set_resume(False)
    yield tmp_path / "out"
    host._headless_output = None
    host.set_resume(False)
