"""Caches under test: gemmdrift's exact sliding-window cache, other public designs, and how someone else's cache or
rollback plugs in (``--cache-impl``, ``--rollback``)."""
