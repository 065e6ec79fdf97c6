"""bench_host.py's lanes of a median window: what lesson 08 draws from the saved run."""


import numpy as np

import labkit as lk
from labkit.analysis.lanes import Lanes
from labkit.engine import Engine
from tests.scripts import load_script

def load_bench():
    return load_script("benchmarks/bench_host.py")


def test_median_window_is_five_decode_steps_with_the_median_idle_share():
    bench = load_bench()
    log = Engine(seed=0, overlap=True).run(lk.Trace.from_lengths([12] * 4, [8] * 4), lk.Continuous(num_slots=4),
                                           progress=False)
    saved = bench.median_window(log)
    lanes = Lanes(np.array(saved["host"]), np.array(saved["device"]))
    assert lanes.device.shape == (5, 2) and lanes.device[0, 0] >= 0
    decode = np.flatnonzero(log.num_prefill_tokens == 0)
    shares = sorted(Lanes.from_log(log, 5, first).device_idle_fraction
                    for first in range(decode[0], decode[-1] - 3))
    assert lanes.device_idle_fraction == shares[len(shares) // 2]
