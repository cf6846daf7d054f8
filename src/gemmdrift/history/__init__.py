"""The history wing: how the tracked figures move across mlx and mlx-lm, release by release and commit by commit.

One flow, each step one place:

* **what is measured**: the tracking tier (:mod:`.tier`): the suite's measurements at tracking sizes, in parts
  (decode, prefill, state, diverge, kernels, fingerprint, ops, golden), each a dict of figures that
  ``benchmarks/bench_tier.py``'s ``track_`` methods read by name; the figure names are asv's. The tier measures
  whatever mlx and mlx-lm it is imported with: measurement code never branches on versions.
* **over what**:
  - the releases: every Linux entry of ``asv.conf.json``, one uv environment each, one gemmdrift commit
    (:mod:`.releases`, ``make history-run``); the pairing of mlx with mlx-lm is :mod:`gemmdrift.matrix`;
  - the bridges: mlx B with the older mlx-lm X, which split a pair that changed both (``--bridges``);
  - the commits: ``gemmdrift bisect`` over a git repository of mlx-lm (installed at each commit) or mlx (built by
    the user's command) (:mod:`.bisect`), or ``asv run``/``asv find`` over them (``asv.mlx-lm.conf.json``,
    ``asv.mlx.conf.json``, whose build step is :mod:`.bisect.asv_build`).
* **how results are stored**: asv's own results directories (:mod:`.asvfiles`): the releases in
  ``benchmarks/reference/reference-linux-cpu-tier/``, the bridges in ``benchmarks/reference/bridges/``, the
  commits in ``benchmarks/reference/bisect/<range>/`` (one record per commit, and the same as asv JSON under
  ``asv/``: :mod:`.bisect.asv_json`).
* **how they are read and said** (lower in the house, since ``gemmdrift upgrade`` and the views read them too):
  :mod:`gemmdrift.measure.history` reads asv's results into one table (``gemmdrift history``, ``gate``);
  :mod:`gemmdrift.changelog` classifies each pair of releases and writes the pages, naming the bridge and the
  commit that moved a pair's figures.
"""
