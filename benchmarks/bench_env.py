"""What ran: the mlx version and backend, tracked so that `gemmdrift history` can read them."""


def track_mlx_version():
    import mlx.core as mx

    from gemmdrift.measure.history import encode_version

    return encode_version(mx.__version__)


track_mlx_version.unit = "major*10000+minor*100+patch"
track_mlx_version.version = "1"
track_mlx_version.direction = "label"
track_mlx_version.timeout = 600  # asv's 60 s: importing mlx on a loaded machine took longer


def track_backend():
    from gemmdrift.machine.envinfo import device_record
    from gemmdrift.measure.history import BACKEND_CODES

    codes = {name: code for code, name in BACKEND_CODES.items()}
    return float(codes.get(device_record()["backend"], -1))


track_backend.unit = "0=cpu 1=metal 2=cuda"
track_backend.version = "1"
track_backend.direction = "label"
track_backend.timeout = 600  # asv's 60 s: importing mlx on a loaded machine took longer


def track_mlx_lm_version():
    """The mlx-lm really imported (the matrix pairs one mlx release with several mlx-lm releases)."""
    from importlib.metadata import version

    from gemmdrift.measure.history import encode_version

    return encode_version(version("mlx-lm"))


track_mlx_lm_version.unit = "major*10000+minor*100+patch"
track_mlx_lm_version.version = "1"
track_mlx_lm_version.direction = "label"
track_mlx_lm_version.timeout = 600  # asv's 60 s: importing mlx on a loaded machine took longer


# The size sets of the main-job probes (common.BENCH_SIZES), numbered for asv.
SIZE_CODES = {"cpu": 0, "gpu": 1}


def track_sizes():
    """Which size set the probes measured (common.sizes(): 'gpu' on Metal/CUDA, 'cpu' elsewhere). The same
    benchmark names hold both, so a machine's series says which it is; `gemmdrift history` draws one line per
    machine and backend, and the backend decides the size set, so the two never share a line."""
    from gemmdrift import suite

    return float(SIZE_CODES[suite.default_sizes()])


track_sizes.unit = "0=cpu 1=gpu sizes"
track_sizes.version = "1"
track_sizes.direction = "label"
track_sizes.timeout = 600  # asv's 60 s: importing mlx on a loaded machine took longer
