import json
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)  # the fake node classes live beside the tests (no packages: importlib mode)

import headless_fake_nodes  # noqa: E402


@pytest.fixture
def fake_nodes():
    """The fake node module, with its call log emptied."""
    headless_fake_nodes.EXECUTED.clear()
    return headless_fake_nodes


@pytest.fixture
def mappings(fake_nodes):
    return dict(fake_nodes.FAKE_NODE_MAPPINGS)


@pytest.fixture
def ui_workflow():
    """A hand-written file in the frontend's save format (version 0.4), see data/sum_graph.ui.json."""
    with open(os.path.join(HERE, "data", "sum_graph.ui.json")) as handle:
        return json.load(handle)


@pytest.fixture
def api_workflow():
    """The same graph as ComfyUI's "Export (API)" would write it."""
    with open(os.path.join(HERE, "data", "sum_graph.api.json")) as handle:
        return json.load(handle)
