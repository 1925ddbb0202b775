"""The direct launcher against an earlier version of it, in one process (GPU): host
time of a fill launch alone and of whole calls, the two launchers alternating call by
call so that the machine's host noise falls on both alike.

    python benchmarks/launcher_ab.py OUT_DIR EARLIER/_utils.py

EARLIER/_utils.py: the earlier version's tq_chunked/runtime/_utils.py (e.g. from
`git archive`), whose Launcher is loaded beside this one and swapped in for the fill
and the merge.
Writes OUT_DIR/launcher-ab.json and prints a table.
"""

import functools
import importlib.util
import json
import statistics
import sys
import time

import torch
from host_profile import CASES, plugin_call  # benchmarks/, this script's folder

from tq_chunked.runtime import dequant, merge
from tq_chunked.runtime._utils import Launcher


def load_earlier(path):
    spec = importlib.util.spec_from_file_location("earlier_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Launcher


def alternate(fns, n=300):
    """Median host microseconds of each fn, called in turn with the GPU kept busy."""
    times = {name: [] for name in fns}
    for _ in range(5):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    for _ in range(n):
        for name, fn in fns.items():
            torch.cuda._sleep(4_000_000)  # ~2 ms of GPU work ahead of the call
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def main(out_dir, earlier_path):
    Earlier = load_earlier(earlier_path)
    launchers = {
        "this": (dequant.launch_fill, merge.launch_merge),
        "earlier": (
            Earlier(dequant.launch_fill.kernel),
            Earlier(merge.launch_merge.kernel),
        ),
    }
    assert all(isinstance(x, Launcher) for x in launchers["this"])

    def use(which):
        dequant.launch_fill, merge.launch_merge = launchers[which]

    rows = [measure(name, requests, launchers, use) for name, requests in CASES]
    with open(f"{out_dir}/launcher-ab.json", "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "earlier": earlier_path,
                "cases": rows,
            },
            f,
            indent=1,
        )


def measure(name, requests, launchers, use):
    """One case: a fill launch alone and whole calls, through each launcher."""
    _, _, _, call = plugin_call(requests)
    answers = {}
    for which in launchers:
        use(which)
        answers[which] = call()
    assert torch.equal(answers["this"], answers["earlier"]), name
    # one fill launch's arguments, as the call makes them
    seen = {}
    dequant.launch_fill = lambda grid, *a, **k: seen.update(grid=grid, a=a, k=k)
    call()
    use("this")
    fill = {
        which: functools.partial(
            launchers[which][0], seen["grid"], *seen["a"], **seen["k"]
        )
        for which in launchers
    }
    calls = {
        which: functools.partial(_call_with, use, which, call) for which in launchers
    }
    launch_us = alternate(fill)
    call_us = alternate(calls, n=200)
    use("this")
    print(
        f"{name:20} fill launch {launch_us['this']:6.1f} / "
        f"{launch_us['earlier']:6.1f} us   whole call {call_us['this']:7.1f} / "
        f"{call_us['earlier']:7.1f} us (this / earlier)",
        flush=True,
    )
    return {"case": name, "fill launch us": launch_us, "whole call us": call_us}


def _call_with(use, which, call):
    use(which)
    call()


if __name__ == "__main__":
    main(*sys.argv[1:3])
