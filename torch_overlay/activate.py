"""``python -m torch_overlay.activate``: install, revert, inspect or check the persistent overlay."""

import sys

from torch_overlay._cli import activate_main

if __name__ == "__main__":
    sys.exit(activate_main())
