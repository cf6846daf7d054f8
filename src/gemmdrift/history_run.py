"""``python -m gemmdrift.history_run`` (the whole history in one command), kept working: the module is
:mod:`gemmdrift.history.releases`."""

import sys

from .history.releases import main

if __name__ == "__main__":
    sys.exit(main())
