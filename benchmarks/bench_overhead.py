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
        from gemmdrift import suite

        self.lm = common.model()
        self.tokens = suite.stream(self.lm, TOKENS)

    def time_plain_mlx_lm(self, schedule):
        from gemmdrift.taps import run_plain

        run_plain(self.lm.model, self.tokens, schedule, split=SPLIT, logit_positions=range(SPLIT, TOKENS))

    def time_tapped(self, schedule):
        from gemmdrift.taps import run_schedule

        run_schedule(self.lm.model, self.tokens, schedule, split=SPLIT, positions=range(SPLIT, TOKENS),
                     logit_positions=range(SPLIT, TOKENS))
