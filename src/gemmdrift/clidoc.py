"""``python -m gemmdrift.clidoc`` (the documentation's flag tables), kept working: the module is
:mod:`gemmdrift.cli.doc`."""

import sys

from .cli.doc import main

if __name__ == "__main__":
    sys.exit(main())
