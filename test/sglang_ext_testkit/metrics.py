"""Prometheus state of `sglang_ext.graphs.stats` reset between tests (the module keeps it per process)."""


def reset_metrics(stats) -> None:
    """Forget whether metrics are on and what was published (`stats`: the module under test)."""
    stats._prom.update(on=None, metrics=None, last={}, gauges={}, children={}, reserved=None)
