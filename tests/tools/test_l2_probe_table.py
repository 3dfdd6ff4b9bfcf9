"""CPU test of tools/l2_probe_table.py (the table of tools/gpu-l2-probe) on a made-up ncu listing."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from l2_probe_table import launches, readers, table  # noqa: E402

HEADER = ("  (anonymous namespace)::two_readers(const int4 *, long, int, int *, int *, unsigned long long *) "
          "(132, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0")


def listing(fabric_mbyte_per_launch, timed_out=()):
    program = [f"launch {j}: first reader SM 0, second reader SM {2 * j}"
               + (" (timed out waiting for the first: not valid)" if j in timed_out else "")
               for j in range(1, len(fabric_mbyte_per_launch) + 1)]
    report = []
    for fabric in fabric_mbyte_per_launch:
        report += [HEADER, "    Metric Name    Metric Unit Metric Value",
                   f"    lts__t_sectors_srcunit_ltcfabric.sum   sector   {int(fabric * 1e6 / 32):,}",
                   "    dram__bytes_read.sum   Mbyte   0.30"]
    return "\n".join(program + ["==PROF== Disconnected"] + report)


class L2ProbeTable(unittest.TestCase):
    def test_split_at_the_largest_gap(self):
        text = listing([8.4, 16.8, 8.5, 16.9])
        runs, who = launches(text), readers(text)
        self.assertEqual(len(runs), 4)
        self.assertEqual(who[1], (2, 0, 4, True))
        self.assertAlmostEqual(runs[1]["fabric"], 16.8, places=3)
        out = table(runs, who).splitlines()
        self.assertEqual(out[-2], "with the first reader's SM (less fabric): 2 6")
        self.assertEqual(out[-1], "the other side (more fabric): 4 8")

    def test_a_timed_out_launch_is_marked_and_left_out(self):
        text = listing([8.4, 30.0, 16.8], timed_out={2})
        out = table(launches(text), readers(text)).splitlines()
        self.assertIn("not valid", out[2])
        self.assertEqual(out[-1], "the other side (more fabric): 6")

    def test_unknown_units_are_an_error(self):
        with self.assertRaises(ValueError):
            launches(HEADER + "\n    dram__bytes_read.sum   Pbyte   1.0")

    def test_other_kernels_are_ignored(self):
        self.assertEqual(launches("  (anonymous namespace)::read_side(const int4 *) (132, 1, 1)\n"
                                  "    dram__bytes_read.sum   Mbyte   1.0"), [])


if __name__ == "__main__":
    unittest.main()
