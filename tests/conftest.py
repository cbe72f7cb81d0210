import os
import sys

# test helpers (small models, comparison utilities) live in tests/helpers and are imported by module name
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
