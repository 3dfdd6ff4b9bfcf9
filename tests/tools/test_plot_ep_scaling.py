"""CPU test of bench/plot_ep_scaling.py's model and loading (no plot: matplotlib may be absent)."""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from plot_ep_scaling import load, model  # noqa: E402


def row(G, impl, fwd, fwd_bwd, sent):
    return {"shape": "qwen3-30b-a3b", "G": G, "impl": impl, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
            "bytes_per_gpu_fwd": sent}


class PlotEpScaling(unittest.TestCase):
    def test_model_bounds(self):
        # compare_ep's bytes: the dispatch's 235 MB and the combine's 235 MB a GPU sends per forward.
        lynx = {1: row(1, "lynx", 1.2, 3.5, 0.0), 8: row(8, "lynx", 1.7, 4.6, 470e6)}
        # 470 MB at 450 GB/s: 1.044 ms on top of G = 1's 1.2 (nothing overlapped), or under it (all).
        slow, fast = model(lynx, 8, "fwd_ms", 450e9)
        self.assertAlmostEqual(slow, 1.2 + 470e6 / 450e9 * 1e3)
        self.assertAlmostEqual(fast, 1.2)
        slow, fast = model(lynx, 8, "fwd_bwd_ms", 450e9)  # the backward moves the rows again
        self.assertAlmostEqual(slow, 3.5 + 2 * 470e6 / 450e9 * 1e3)
        self.assertAlmostEqual(fast, 3.5)
        slow, fast = model(lynx, 8, "fwd_bwd_ms", 100e9)  # a slow link: link-bound when all overlaps
        self.assertAlmostEqual(fast, 2 * 470e6 / 100e9 * 1e3)
        self.assertEqual(model(lynx, 1, "fwd_ms", 450e9), (1.2, 1.2))

    def test_load_groups_rows_by_shape_impl_and_g(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for G in (1, 2):
                p = os.path.join(d, f"ep_{G}.json")
                with open(p, "w") as f:
                    json.dump({"date": "2026-12-05", "gpu": "H200", "G": G, "commit": "abc1234",
                               "results": [row(G, "lynx", 1.0 + G, 3.0, 0.0), row(G, "torch", 2.0, 5.0, 0.0)]}, f)
                paths.append(p)
            rows, runs = load(paths)
        self.assertEqual(sorted(rows[("qwen3-30b-a3b", "lynx")]), [1, 2])
        self.assertEqual(rows[("qwen3-30b-a3b", "lynx")][2]["fwd_ms"], 3.0)
        self.assertEqual(runs[0], "G = 1: 2026-12-05, H200, commit abc1234")


if __name__ == "__main__":
    unittest.main()
