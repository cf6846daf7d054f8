"""``python -m gemmdrift.serve_launch`` (mlx_lm.server with a plug-in cache installed), kept working: the module is
:mod:`gemmdrift.caches.serve_launch`."""

import sys

from .caches.serve_launch import main

if __name__ == "__main__":
    sys.exit(main())
