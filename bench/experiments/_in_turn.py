"""Median times of several calls on the same inputs, taken in rounds in turn (so that a
slow spell of the machine hits every call alike)."""

from __future__ import annotations

import statistics

from triton.testing import do_bench


def medians_in_turn(fns: dict, *args, rounds: int = 5, timer=None) -> dict:
    """{name: median ms} of ``fns[name](*args)`` over ``rounds`` rounds, after a first call
    of each (compilation); ``timer(call) -> ms`` (default: do_bench, 25 ms warm-up, 100 ms)."""
    timer = timer or (lambda call: do_bench(call, warmup=25, rep=100))
    for f in fns.values():
        f(*args)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            times[name].append(timer(lambda: f(*args)))
    return {name: statistics.median(t) for name, t in times.items()}
