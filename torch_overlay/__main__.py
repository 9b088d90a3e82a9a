"""``python -m torch_overlay``: the ``torch-overlay`` command."""

import sys

from torch_overlay._cli import main

if __name__ == "__main__":
    sys.exit(main())
