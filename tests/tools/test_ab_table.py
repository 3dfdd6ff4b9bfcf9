"""CPU test of tools/ab_table.py (the table of tools/gpu-ab) on made-up lynx-bench results."""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import ab_table  # noqa: E402


def run(forward, backward=None):
    rows = [{"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "forward", "ms": forward}]
    if backward is not None:
        rows.append({"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "backward", "ms": backward})
    return {"results": rows}


class AbTable(unittest.TestCase):
    def test_medians_ratios_and_rounds_faster(self):
        # Build 1 is faster than build 0 in rounds 1 and 3, slower in round 2; build 2 missed round 3.
        runs = [(0, 1, run(1.20, 2.40)), (0, 2, run(1.22, 2.50)), (0, 3, run(1.30, 2.45)),
                (1, 1, run(1.10, 2.50)), (1, 2, run(1.25, 2.55)), (1, 3, run(1.20, 2.60)),
                (2, 1, run(1.30)), (2, 2, run(1.10))]
        lines = ab_table.table(ab_table.collect(runs), ["build-main", "build-cand", "build-x"]).splitlines()
        # Names without their "build-" prefix; each later build's ratio and rounds-faster columns.
        self.assertEqual(lines[0].split(), ["shape", "routing", "pass", "main", "cand", "x", "cand/A", "faster", "x/A",
                                            "faster"])
        forward = lines[1].split()
        self.assertEqual(forward[:3], ["qwen3-30b-a3b", "uniform", "forward"])
        # Medians 1.220, 1.200, 1.200; ratios 0.984 (2 of 3 rounds faster) and 0.984 (1 of 2).
        self.assertEqual(forward[3:], ["1.220", "1.200", "1.200", "0.984", "2/3", "0.984", "1/2"])
        backward = lines[2].split()
        # Build 2 has no backward: its cells are dashes, 0 of 0 rounds.
        self.assertEqual(backward[3:], ["2.450", "2.550", "-", "1.041", "0/3", "-", "0/0"])

    def test_regimes_of_one_pass_are_kept_apart(self):
        # lynx-bench --regime all gives a burst and a sustained row per pass; older files have no regime.
        rows = [{"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "forward", "regime": "burst", "ms": 1.1},
                {"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "forward", "regime": "sustained", "ms": 1.3},
                {"shape": "qwen3-30b-a3b", "routing": "uniform", "pass": "backward", "ms": 2.3}]
        times = ab_table.collect([(0, 1, {"results": rows})])
        self.assertEqual(times[("qwen3-30b-a3b", "uniform", "forward burst")], {0: {1: 1.1}})
        self.assertEqual(times[("qwen3-30b-a3b", "uniform", "forward sustained")], {0: {1: 1.3}})
        self.assertEqual(times[("qwen3-30b-a3b", "uniform", "backward")], {0: {1: 2.3}})

    def test_precision_rows_and_their_digests(self):
        # lynx-bench --precision fp8: rows named by what they time, no routing, each with the digests.
        def fp8_run(ms, bits):
            return {"results": [{"shape": "qwen3-30b-a3b", "regime": "as-found", "what": w, "ms": m, "fp8_bits": bits,
                                 "fp8_bf16_wgrad_bits": "58051bfe8d831eea"}
                                for w, m in [("forward bf16", 1.2), ("forward fp8", ms)]]}
        runs = [(0, 1, fp8_run(1.03, "717533af926d93c5")), (1, 1, fp8_run(0.95, "717533af926d93c5")),
                (2, 1, fp8_run(0.90, "0000000000000001"))]
        times = ab_table.collect(runs)
        self.assertEqual(times[("qwen3-30b-a3b", "-", "forward fp8")], {0: {1: 1.03}, 1: {1: 0.95}, 2: {1: 0.90}})
        lines = ab_table.digests(runs, ["base", "cand", "wrong"])
        self.assertEqual(lines, [
            "FP8 output bits, qwen3-30b-a3b, base: 717533af926d93c5/58051bfe8d831eea",
            "FP8 output bits, qwen3-30b-a3b, cand: 717533af926d93c5/58051bfe8d831eea (the first build's)",
            "FP8 output bits, qwen3-30b-a3b, wrong: 0000000000000001/58051bfe8d831eea (DIFFERS from the first build's)"])
        self.assertEqual(ab_table.digests([(0, 1, run(1.0))], ["base"]), [])

    def test_a_repeated_build_is_labelled_the_control(self):
        self.assertEqual(ab_table.labels(["x/build-a", "build-b/", "y/build-a", "build-a"]),
                         ["build-a", "build-b", "build-a-control", "build-a-control2"])

    def test_main_writes_every_run_and_prints_the_table(self):
        with tempfile.TemporaryDirectory() as work:
            for build, rnd, ms in [(0, 1, 1.2), (1, 1, 1.1)]:
                with open(os.path.join(work, f"{build}-{rnd}.json"), "w") as f:
                    json.dump(run(ms), f)
            ab_table.main(["ab_table.py", work, work, "2", "build-a", "build-b"])
            with open(os.path.join(work, "ab.json")) as f:
                raw = json.load(f)
            self.assertEqual([(r["build"], r["round"]) for r in raw], [("build-a", 1), ("build-b", 1)])

    def test_an_unfinished_run_is_left_out(self):
        with tempfile.TemporaryDirectory() as work:
            with open(os.path.join(work, "0-1.json"), "w") as f:
                json.dump(run(1.2), f)
            with open(os.path.join(work, "1-1.json"), "w") as f:
                f.write('{"results": [{"shape": "qwen3-30b-a3b", "ms": ')  # a run that stopped writing
            ab_table.main(["ab_table.py", work, work, "1", "build-a", "build-b"])
            with open(os.path.join(work, "ab.json")) as f:
                raw = json.load(f)
            self.assertEqual([(r["build"], r["round"]) for r in raw], [("build-a", 1)])


if __name__ == "__main__":
    unittest.main()
