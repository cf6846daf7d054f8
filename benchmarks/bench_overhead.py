"""What the layer taps cost: a tapped run against the same schedule through plain mlx-lm calls.

Both read the logits of every continuation position, as decoding does.
"""

from . import common

SCHEDULES = ["prefill:32,decode", "prefill:32,verify:2"]
TOKENS, SPLIT = 64, 32


class TapOverhead:
    params = (SCHEDULES,)
    param_names = ["schedule"]
    timeout = 1200
    number = 1
    repeat = 1  # one decode run is ~10 s on the CPU (more on a loaded one): one sample is a stable figure
    warmup_time = 0
    rounds = 1  # asv's default is 2: every case twice, each in a new process that loads the model

    def setup(self, schedule):
        common.skip_unless_full(None, "TapOverhead")
        from gemmdrift import suite

        self.lm = common.model()
        self.tokens = suite.stream(self.lm, TOKENS)
        if common.on_gpu():
            # On a GPU the first run uploads the lazily loaded weights and builds every kernel on first use
            # (Metal pipelines, CUDA's JIT): seconds against a ~0.1 s run. Both, untimed, before the timed one.
            # (The CPU keeps its series as it was: the versions below are the hashes asv gave it before.)
            import mlx.core as mx

            mx.eval(self.lm.model.parameters())
            self.time_plain_mlx_lm(schedule)
            self.time_tapped(schedule)

    def time_plain_mlx_lm(self, schedule):
        from gemmdrift.model.taps import run_plain

        run_plain(self.lm.model, self.tokens, schedule, split=SPLIT, logit_positions=range(SPLIT, TOKENS))

    time_plain_mlx_lm.version = "c13cdbb075cbf81b0df0dd7bc15eb5598c594bab4710d44ff7e7fd4404eba72f"

    def time_tapped(self, schedule):
        from gemmdrift.model.taps import run_schedule

        run_schedule(self.lm.model, self.tokens, schedule, split=SPLIT, positions=range(SPLIT, TOKENS),
                     logit_positions=range(SPLIT, TOKENS))

    time_tapped.version = "da9b217e9f48ebcc60c5284af74d746277b958578f411b7a5748c8b0a9902e9a"
