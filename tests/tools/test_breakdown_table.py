"""CPU test of tools/breakdown_table.py (the table of tools/gpu-breakdown) on made-up lynx-bench results."""
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from breakdown_table import collect, table  # noqa: E402


def run(forward, backward):
    results = [{"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "forward", "ms": forward},
               {"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "backward", "ms": backward},
               {"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "forward+backward", "ms": forward + backward}]
    return json.dumps({"results": results})


class BreakdownTable(unittest.TestCase):
    def test_saved_time_against_the_median_full_pass(self):
        runs = [("none", run(1.40, 2.50)), ("none", run(1.44, 2.90)), ("none", run(1.42, 2.60)),
                ("down", run(1.05, 2.55)), ("down", run(1.03, 2.70)), ("down", run(1.07, 2.58)),
                ("wgrad_gate_up", run(1.41, 1.80))]
        lines = table(collect(runs)).splitlines()
        self.assertEqual(lines[0], "qwen3-30b-a3b uniform backward: 2.600 ms in full (rounds 2.500-2.900, n=3)")
        # wgrad_gate_up is a backward stage: 2.600 - 1.800 saved, 30.8% of the backward.
        self.assertEqual(lines[2].split(), ["wgrad_gate_up", "1.800", "0.800", "30.8%"])
        forward = lines.index("qwen3-30b-a3b uniform forward: 1.420 ms in full (rounds 1.400-1.440, n=3)")
        # down is a forward stage: median 1.050, saved 0.370 of 1.420.
        self.assertEqual(lines[forward + 2].split(), ["down", "1.050", "0.370", "26.1%"])
        # Backward stages are not listed under the forward, nor the combined pass at all.
        self.assertNotIn("wgrad_gate_up", "\n".join(lines[forward:]))
        self.assertNotIn("forward+backward", "\n".join(lines))

    def test_the_glue_row_in_every_pass(self):
        runs = [("none", run(1.40, 2.60)), ("glue", run(1.25, 2.35))]
        lines = table(collect(runs)).splitlines()
        both = lines.index("qwen3-30b-a3b uniform forward+backward: 4.000 ms in full (rounds 4.000-4.000, n=1)")
        self.assertEqual(lines[both + 2].split(), ["glue", "3.600", "0.400", "10.0%"])
        forward = lines.index("qwen3-30b-a3b uniform forward: 1.400 ms in full (rounds 1.400-1.400, n=1)")
        self.assertEqual(lines[forward + 2].split(), ["glue", "1.250", "0.150", "10.7%"])

    def test_a_pass_without_its_full_run_is_left_out(self):
        self.assertEqual(table(collect([("down", run(1.0, 2.0))])), "")


if __name__ == "__main__":
    unittest.main()
