"""CPU test of tools/fp8_tile_costs.py: the tiles and K blocks of a shape, the parse of ncu's CSV (one row
per launch and metric, values with thousands separators, other kernels left out), the forward's pair of
launches, and the fit recovering a tile's and a K block's cost."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import fp8_tile_costs as ftc  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(launch, name, metric, value):
    return (f'"{launch}","1","lynx-bench","127.0.0.1","{name}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","","{value}"')


class Fp8TileCosts(unittest.TestCase):
    def test_qwen3_launches(self):
        geo = ftc.launches_of(ftc.parse_shape("8192,2048,768,128,8"), 132)
        # 512 rows an expert: 4 row blocks each, 512 in all; gate/up 6 tiles across I, down 8 across H.
        self.assertEqual(geo[ftc.SWIGLU], (3072, 16, 24))
        self.assertEqual(geo[ftc.GROUPED], (4096, 6, 32))
        # Rows not a multiple of 128 round up per expert; K not a multiple of 128 takes a last block.
        geo = ftc.launches_of((100, 200, 300, 4, 2), 132)
        self.assertEqual(geo[ftc.SWIGLU], (4 * 3, 2, 1))
        self.assertEqual(geo[ftc.GROUPED], (4 * 1, 3, 1))

    def test_bad_shapes(self):
        with self.assertRaises(ValueError):
            ftc.parse_shape("8192,2048,768,128")
        with self.assertRaises(ValueError):
            ftc.parse_shape("8192,0,768,128,8")
        with self.assertRaises(ValueError):  # 7 * 3 rows over 4 experts: not balanced
            ftc.launches_of((7, 128, 128, 4, 3), 132)

    def test_parse_and_pair(self):
        gate = "void gemm_kernel<2, unsigned short, 1>(CUtensorMap_st, int)"
        down = "void gemm_kernel<1, unsigned short, 0>(CUtensorMap_st, int)"
        wgrad = "void gemm_kernel<3, unsigned short, 0>(CUtensorMap_st, int)"
        text = "\n".join([
            "==PROF== Connected to process 1", "lynx-bench  NVIDIA H100 80GB HBM3", HEADER,
            row(0, down, "gpu__time_duration.sum", "1,000"), row(0, down, "sm__cycles_elapsed.max", "1,980"),
            row(1, gate, "gpu__time_duration.sum", "552,000"), row(1, gate, "sm__cycles_elapsed.max", "1,092,960"),
            row(2, wgrad, "gpu__time_duration.sum", "330,000"), row(2, wgrad, "sm__cycles_elapsed.max", "653,400"),
            row(3, down, "gpu__time_duration.sum", "284,000"), row(3, down, "sm__cycles_elapsed.max", "562,320"),
            row(4, "void quantize_tiles_kernel(int)", "gpu__time_duration.sum", "18,000"),
        ])
        launches = ftc.parse_ncu(text)
        self.assertEqual([f for f, _, _ in launches], [1, 2, 3, 1])
        self.assertEqual(launches[1], (2, 552000.0, 1092960.0))
        # The down launch before the first gate/up is not the forward's.
        self.assertEqual(ftc.forward_pair(launches), ((552000.0, 1092960.0), (284000.0, 562320.0)))
        with self.assertRaises(ValueError):
            ftc.forward_pair([(1, 1.0, 1.0), (2, 1.0, 1.0)])

    def test_fit_recovers_costs(self):
        a, b = 9000.0, 2200.0
        points = [(n, k, n * (a + b * k)) for n, k in ((24, 8), (24, 16), (24, 32), (12, 16), (48, 16))]
        fa, fb = ftc.fit(points)
        self.assertAlmostEqual(fa, a, places=6)
        self.assertAlmostEqual(fb, b, places=6)
        with self.assertRaises(ValueError):  # one K: a tile's and a K block's costs are not separable
            ftc.fit([(24, 16, 1.0), (12, 16, 0.5)])

    def test_table(self):
        shapes = [ftc.parse_shape(s) for s in ftc.DEFAULT_SHAPES]
        rows = []
        for s in shapes:
            geo = ftc.launches_of(s, 132)
            meas = {}
            for form, (a, b) in ((ftc.SWIGLU, (9000.0, 2200.0)), (ftc.GROUPED, (7000.0, 1800.0))):
                _, k, n = geo[form]
                cycles = n * (a + b * k)
                meas[form] = (cycles / 1.98, cycles)  # ns at 1980 MHz
            rows.append((s, geo, meas))
        text = ftc.table(rows, 132)
        self.assertIn("gate/up: a =     9000 cycles a tile (  4.55 us at 1980 MHz), b =   2200", text)
        self.assertIn("down: a =     7000 cycles a tile", text)
        self.assertIn("+0.0%", text)


if __name__ == "__main__":
    unittest.main()
