import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # dist_workflow.py lives beside the tests (no packages: importlib mode)
