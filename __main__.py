"""`python -m tightrope ...` is the `tightrope` command."""
import sys

from .cli import main

sys.exit(main())
