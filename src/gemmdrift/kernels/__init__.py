"""Kernel isolation: GEMV (T=1) against batched GEMM (T>1), per projection of every layer.

Decoding feeds one token per step, so every linear is a matrix-vector product;
speculative verification and chunked prefill feed T tokens, a matrix-matrix
product. This module measures, for every linear of every decoder layer and
for the LM head, whether the same input row gives the same output bits both
ways, on the model's real weights and on real activations:

1. :func:`projections` lists the linears (``layer``, ``name``).
2. :func:`capture_inputs` records real input rows of each one during one
   forward pass of the model over a real prompt.
3. :func:`sweep` computes every distinct row alone (T=1, the GEMV) and then,
   for each T, one GEMM over a block of T rows made by cycling the captured
   rows, and compares each block row with its T=1 result, bit for bit. It also
   scores every path against a float64 numpy reference computed from the same
   stored operands.
4. :func:`ops_sweep` does the same for the other ops whose shape changes
   between decode and verification: attention, RMSNorm, RoPE and softmax.

Paths (how a projection is computed):

* ``model``: the module as loaded (nn.Linear in the compute dtype, or the
  checkpoint's own QuantizedLinear).
* ``dense:<dtype>``: the dense weights cast to bfloat16/float16/float32, the
  input cast alike, computed by nn.Linear.
* ``quant:<mode>-q<bits>-g<group>``: the dense weights quantized by
  ``nn.QuantizedLinear.from_linear``, as ``mlx_lm.convert -q`` does.
* ``emulated:splitk<P>``: a NEGATIVE CONTROL, not a real kernel. T=1 runs the
  real dense kernel; T>=2 splits K into P partitions whose float32 partial
  products are summed in order, as a split-K GEMM would. It proves the sweep
  can see a reduction-order change; its rows carry ``emulated=True`` and are
  never mixed into real results.

On the Linux CPU backend every real path is row-invariant (see
:mod:`gemmdrift.dispatch`), so an honest sweep reports exact zeros there.

Tidy output columns: layer, projection, path, dtype, quant, emulated,
synthetic, inputs, K, N, key_length (ops only), T, metric, value. Drift
metrics (those of :func:`metrics.compare`, plus ``rows_differ`` and
``worst_position``) exist for every GEMM block size T>=2 and, when T=1 is
asked for, for a second T=1 call on the first row (run-to-run determinism);
error metrics (``err_*``, see :func:`metrics.error_vs_exact`) exist for T=1
(every distinct row used) and for every block.

The package, by job (each module imports only those listed before it):

* :mod:`gemmdrift.model.projections`: projections and captured input rows;
* :mod:`.paths`: paths, operators, float64 references, timing bodies;
* :mod:`.table`: the tidy table, dispatch switches, the ``kernels`` Result and its figures;
* :mod:`.ops`: the other ops (sdpa, rms_norm, rope, softmax);
* :mod:`.runs`: the sweep with its checkpoints, and ``measure_kernels`` / ``measure_ops``.
"""

from ..model.projections import *  # noqa: F401,F403
from ..model.projections import __all__ as _capture
from .paths import *  # noqa: F401,F403
from .paths import __all__ as _paths
from .table import *  # noqa: F401,F403
from .table import reference_backend  # noqa: F401  (gemmdrift.fingerprint reads it)
from .table import __all__ as _table
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _ops
from .runs import *  # noqa: F401,F403
from .runs import __all__ as _runs

__all__ = [*_capture, *_paths, *_table, *_ops, *_runs]
