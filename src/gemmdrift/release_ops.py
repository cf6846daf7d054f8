"""``python -m gemmdrift.release_ops`` (which op moved between two mlx releases), kept working: the module is
:mod:`gemmdrift.attribution.release_ops`."""

import sys

from .attribution.release_ops import main

if __name__ == "__main__":
    sys.exit(main())
