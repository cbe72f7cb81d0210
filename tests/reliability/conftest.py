import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reliability_kit lives beside the tests (no packages: importlib mode)

from tightrope.nodes import host  # noqa: E402


@pytest.fixture
def out(tmp_path):
    """Headless output (= loras) folder for node runs, without --resume; the host is restored afterwards."""
    with host.headless(tmp_path / "out"):
        yield tmp_path / "out"
