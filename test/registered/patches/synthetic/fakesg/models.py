"""Users of the runner (synthetic target of test_patch_series)."""

from fakesg.runner import Runner

runners = {"cpu": Runner}


def make(device, n):
    return runners[device](n)
