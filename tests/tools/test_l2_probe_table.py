"""CPU test of tools/l2_probe_table.py (the table of tools/gpu-l2-probe) on a made-up ncu listing."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from l2_probe_table import launches, table  # noqa: E402

HEADER = ("  (anonymous namespace)::read_side(const int4 *, long, int, int, unsigned int, unsigned long long *) "
          "(132, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0")


def launch(fabric_sectors, dram_mbyte):
    return [HEADER, "    Metric Name    Metric Unit Metric Value",
            f"    lts__t_sectors_srcunit_ltcfabric.sum   sector   {fabric_sectors:,}",
            f"    dram__bytes_read.sum   Mbyte   {dram_mbyte}"]


class L2ProbeTable(unittest.TestCase):
    def test_second_reads_per_rule(self):
        lines = []
        for fabric, dram in ((1, 16.0), (2, 0.5), (3, 16.0), (1_000_000, 8.25)):  # rule 0
            lines += launch(fabric, dram)
        runs = launches("\n".join(lines))
        self.assertEqual(len(runs), 4)
        self.assertAlmostEqual(runs[3]["fabric"], 32.0)  # 1,000,000 sectors of 32 bytes, in MB
        rows = table(runs).splitlines()
        self.assertEqual(len(rows), 3)
        self.assertTrue(rows[1].split()[:3] == ["0", "same", "side"])
        self.assertEqual(rows[1].split()[-1], "0.5")
        self.assertEqual(rows[2].split()[-1], "8.2")
        self.assertEqual(rows[2].split()[-3], "32.0")

    def test_other_kernels_are_ignored(self):
        text = "\n".join(["  (anonymous namespace)::flush(int4 *, long) (528, 1, 1)x(256, 1, 1)",
                          "    dram__bytes_read.sum   Mbyte   1.0"])
        self.assertEqual(launches(text), [])


if __name__ == "__main__":
    unittest.main()
