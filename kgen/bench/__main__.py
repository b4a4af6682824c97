"""``python -m kgen.bench``: ``kgen bench`` without the main CLI (e.g. on a GPU machine)."""

import sys

from kgen.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
