"""``python -m twisternet``: the same command line as the ``twisternet`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
