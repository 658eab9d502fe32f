"""Host seconds one AutoGamma decision takes (B sequences, 4 candidate gammas, mid-batch): the time the GPU would sit
idle per verification if the decoder chose after its sync instead of while the GPU runs the previous verification.

    python benchmarks/planner/policy_host_cost.py
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from magicdec.planner import AutoGamma  # noqa: E402


def main():
    rng, rows = np.random.default_rng(0), []
    for B in (1, 16, 128):
        for left in (63, 20):
            p = AutoGamma([1, 2, 3, 4], 0.9, spread=0.06)
            p.costs = {0: 0.0109, 1: 0.0173, 2: 0.0222, 3: 0.0272, 4: 0.0321}
            remaining = np.clip(left + rng.integers(-3, 4, B), 1, None).tolist()
            p.choose(remaining)  # builds the tables once
            start = time.perf_counter()
            for _ in range(200):
                p.observe(rng.integers(0, 3, B).tolist(), [3] * B)
                p.on, p.off = True, False
                p.choose(remaining)
            rows.append({"B": B, "tokens_left": left, "us_per_decision": (time.perf_counter() - start) / 200 * 1e6})
            print(f"B={B:4d} tokens left ~{left:3d}: {rows[-1]['us_per_decision']:8.1f} us per decision")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
