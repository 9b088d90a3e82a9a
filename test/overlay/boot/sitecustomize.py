"""Boot directory of the test suite: ``PYTHONPATH=test/overlay/boot`` runs the overlay's start-up hook in
every interpreter, spawned test ranks included, exactly as the persistent ``.pth`` install does, without
installing anything. ``TORCH_OVERLAY=0`` keeps a process tree on stock torch (``make test`` sets both).
"""

import _torch_harness

from torch_overlay._startup import boot

boot()
_torch_harness.install()
