"""gemmdrift: floating-point drift in MLX, measured on real Gemma weights."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# numpy asks Linux for transparent huge pages on every large array (madvise). Where the kernel compacts
# memory to find them at the first touch (THP defrag "madvise", the default of many kernels), a fresh
# 126 MB array -- the logits of 60 positions in float64, which every comparison makes -- costs 0.4 s
# instead of 0.06 s, and comparing two schedules' logits took 12 s instead of 2. Values are the same
# either way. A user's own NUMPY_MADVISE_HUGEPAGE is left as it is; spawned workers inherit the setting.
if "NUMPY_MADVISE_HUGEPAGE" not in _os.environ:
    _os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read by numpy when it is imported
    _np = _sys.modules.get("numpy")
    if _np is not None:  # imported already: tell it directly
        _core = getattr(_np, "_core", None) or getattr(_np, "core", None)
        _set = getattr(getattr(_core, "multiarray", None), "_set_madvise_hugepage", None)
        if _set is not None:
            _set(False)
