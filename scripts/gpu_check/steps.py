"""The steps of the GPU check, in order, each one or more gemmdrift commands with a time budget.

Every command is gemmdrift's CLI (``python -m gemmdrift ...``) or ``measure.py`` (gemmdrift's library), run in a
process of its own with the step's remaining budget as its timeout: a step that runs out is ``timeout``, the
commands that checkpoint (replay check, kernels, stack) resume on the next try, and the next step starts.

Budgets (``SIZES["gpu"]``) are ceilings, set so that the whole check fits the 15 minutes of device time of one
session (start and transfers included): steps 1-3 need no weights and run while the weights travel; steps
4-7 start when the GGUF is installed. None of them has been timed on a GPU yet: the first run records each
step's seconds in result.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

SIZES = {
    # On the GPU machine: the embedded Gemma at the main job's gpu sizes where a step has them.
    "gpu": {
        "budget": {"env": 60, "repeat": 90, "primitives": 120, "replay-check": 150, "kernels": 100, "stack": 100,
                   "predict": 80},
        "repeat": ["--model", "shape:gemma3-270m", "--tokens", "600", "--split", "512", "--ts", "1,2,3,4,8,33"],
        # (shape, bits): dense bf16, then the config's quantization block as mlx-lm's loader reads it
        "primitives": [("gemma3-270m", None), ("gemma3-270m", 4), ("gemma3-270m", 8),
                       ("gemma4-31b", None), ("gemma4-31b", 4), ("gemma4-31b", 8)],
        "primitives_args": ["--ts", "1-8"],
        "replay-check": ["--layers", "0,5,17,18", "--head-rows", "4096"],
        # suite.SIZES["gpu"]: T 1-17,24,32,33,64,128,512, six paths, 64 rows, FLOP budget 1e12; three layers + head
        "kernels": ["--sizes", "gpu", "--layers", "0,5,17"],
        "stack": ["--tokens", "2600", "--split", "2300", "--ladder"],
        "predict": "gpu",
    },
    # The same code paths on this CPU in seconds (tests/test_gpu_check.py): one layer, one projection, T 1-2.
    "small": {
        "budget": {"env": 60, "repeat": 90, "primitives": 120, "replay-check": 90, "kernels": 90, "stack": 90,
                   "predict": 120},
        "repeat": ["--tokens", "12", "--split", "8", "--ts", "1,2", "--schedules", "prefill:8,decode"],
        "primitives": [("gemma3-270m", None), ("gemma3-270m", 4)],
        "primitives_args": ["--ts", "1-2", "--ops", "q_proj"],
        "replay-check": ["--layers", "0", "--projections", "q_proj", "--ts", "1,2", "--rows", "2", "--tokens", "8",
                         "--paths", "dense:bfloat16", "--no-order-rows"],
        "kernels": ["--sizes", "quick"],
        "stack": ["--tokens", "12", "--split", "8", "--ladder", "--no-local"],
        "predict": "quick",
    },
}


# The embedded Gemma's GGUF -> the cached mlx-lm checkpoint, once, timed apart (the first step with weights).
CONVERT = "from gemmdrift.model import gguf_gemma as g; print(g.converted_dir(g.embedded_gguf()))"


@dataclass
class Command:
    label: str
    argv: list[str]
    json_out: Path | None = None  # where its JSON result is (stdout for --json commands)
    stdout_json: bool = False


@dataclass
class Step:
    name: str
    title: str
    needs_weights: bool
    answers: str
    commands: list[Command] = field(default_factory=list)


def gd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gemmdrift", *args]


def measure(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve().parent / "measure.py"), *args]


def quant_config(work: Path, shape: str, bits: int) -> Path:
    """A config-only model directory: ``shape:NAME``'s config with a quantization block (no weights: the
    primitives gate reads shapes and quantization from the config alone)."""
    from gemmdrift.model import SHAPES  # imported only when the step is built (gemmdrift is on the path then)

    d = work / "configs" / f"{shape}-q{bits}"
    d.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape], quantization={"group_size": 64, "bits": bits})
    (d / "config.json").write_text(json.dumps(config, indent=1))
    return d


def build(sizes: str, device: str, model: str, work: Path) -> list[Step]:
    s = SIZES[sizes]
    out = work / "steps"
    dev = ["--device", device]
    steps = [
        Step("env", "gemmdrift env --device gpu --json", False,
             "the device, its CUDA arch and the TF32 state, as every result records them",
             [Command("env", gd("env", *dev, "--json"), stdout_json=True)]),
        Step("repeat", "run-to-run repeatability: the same schedule twice, the layer stack and one projection", False,
             "whether this device gives the same bits twice; if not, every later verdict is qualified",
             [Command("repeat", measure("repeat", *dev, *(s["repeat"] if "--model" in s["repeat"]
                                                         else ["--model", model, *s["repeat"]]),
                                        "--json", str(out / "repeat" / "repeat.json")),
                      json_out=out / "repeat" / "repeat.json")]),
    ]
    prim = []
    for shape, bits in s["primitives"]:
        label = shape + (f"-q{bits}" if bits else "-bf16")
        source = f"shape:{shape}" if bits is None else str(quant_config(work, shape, bits))
        prim.append(Command(label, gd("attribute", "--primitives", "--model", source, *dev, *s["primitives_args"],
                                      "--out", str(out / "primitives" / label), "--json"), stdout_json=True))
    steps.append(Step("primitives", "attribute --primitives at the embedded Gemma's and gemma4-31b's shapes", False,
                      "per op: is a T-row call bit-equal to T single-row calls here, and up to which width", prim))
    cal = out / "replay-check" / "calibration.json"
    steps += [
        Step("replay-check", "replay check --device gpu: the calibration file", True,
             "which replay variant this chip's kernels are, bit for bit (calibration.json)",
             ([Command("convert", [sys.executable, "-c", CONVERT])] if model == "embedded" else []) +
             [Command("replay-check", gd("replay", "check", "--model", model, *dev, *s["replay-check"],
                                         "--out", str(out / "replay-check"), "--json"), stdout_json=True)]),
        Step("kernels", "the kernels probe on real rows (the main job's, at its sizes)", True,
             "GEMV vs GEMM per projection and path on captured rows: where T>1 changes the bits",
             [Command("kernels", measure("kernels", "--model", model, *dev, *s["kernels"],
                                         "--out", str(out / "kernels"), "--json", str(out / "kernels" / "kernels.json")),
                      json_out=out / "kernels" / "kernels.json")]),
        Step("stack", "decode vs verify:2 and verify:3 on the embedded Gemma, with the ladder", True,
             "the drift of decode vs verification through the layers and at the logits, and the ladder's verdict",
             [Command("stack", gd("stack", "--model", model, *dev, *s["stack"], "--out", str(out / "stack"), "--json"),
                      stdout_json=True)]),
        Step("predict", "the main job's prediction part against what was measured", True,
             "the replayed sm90 gemv decode against this device's decode (decode-vs-cpu of sm90: 0 = the replay "
             "is exact), and the Metal predictions beside it; predict_drift names this device's measured line "
             "'cpu' whatever the device, so here 'cpu' in a figure's name is the GPU",
             [Command("predict", measure("predict", "--model", model, *dev, "--sizes", s["predict"],
                                         "--calibration", str(cal), "--out", str(out / "predict"),
                                         "--json", str(out / "predict" / "predict.json")),
                      json_out=out / "predict" / "predict.json")]),
    ]
    return steps


def answer(step: str, data: dict) -> dict:
    """The few fields of a command's JSON that answer the step's question (the whole JSON is in the bundle)."""
    keep = {
        "env": ("backend", "device_name", "architecture", "mlx_backend_package", "mlx_backend_problems", "env",
                "tf32_policy", "fp32_matmul_mode", "cuda"),
        "repeat": ("repeatable", "model", "tokens", "split"),
        "primitives": ("ok", "exact_width", "error", "kernels", "seconds"),
        "replay-check": ("chip", "device_chip", "mlx_version", "prediction", "calibration"),
        "predict": ("figures", "calibration", "backend"),
        "kernels": ("sizes", "layers", "real_drift", "emulated_control_detected", "paths"),
    }.get(step)
    if keep is None:  # stack: its summary (a few kB: every pair's envelope and ladder verdict)
        return dict(data)
    return {k: data[k] for k in keep if k in data}
