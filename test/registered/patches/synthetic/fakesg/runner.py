"""A graph runner in the shape of sglang's (synthetic target of test_patch_series)."""

import math


class Runner:
    def __init__(self, n):
        self.n = n

    def key(self, x):
        return len(x)

    # The original run, kept as _ext_orig_run by the adapter.
    def run(self, x):
        return ("orig", self.key(x))

    @staticmethod
    def kind():
        return "plain"


def runner_name():
    return "runner"
