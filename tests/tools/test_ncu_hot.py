"""CPU test of tools/ncu_hot.py on a made-up Nsight Compute source page (two kernels)."""
import csv
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import ncu_hot  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_barrier (Not Issued)"]


def page(kernels):
    """The CSV text of kernels [(name, [(address, source, samples, executed, barrier, long_sb)])]."""
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    for name, rows in kernels:
        w.writerow(["Kernel Name", name])
        w.writerow(HEADER)
        for a, src, samples, executed, barrier, long_sb in rows:
            w.writerow([a, src, f"{samples:,}", f"{executed:,}", barrier, long_sb, barrier])
    return out.getvalue()


class NcuHot(unittest.TestCase):
    def setUp(self):
        # Kernel "loop": a 3-instruction region run 1000 times (90 of its 100 samples), and a 1-instruction
        # region run 10 times; kernel "other" a single instruction.
        self.text = page([
            ("loop", [("0x10", "FFMA R1, R2, R3, R1", 20, 1000, 0, 0),
                      ("0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 60, 1000, 55, 0),
                      ("0x30", "@P0   BRA 0x10", 10, 1000, 0, 9),
                      ("0x40", "STG.E.128 desc[UR4][R2.64], R8", 10, 10, 0, 8)]),
            ("other", [("0x10", "EXIT", 5, 2, 0, 0)]),
        ])

    def test_kernels_and_rows_are_read(self):
        found = ncu_hot.kernels(csv.reader(io.StringIO(self.text)))
        self.assertEqual([name for name, _, _ in found], ["loop", "other"])
        self.assertEqual([len(rows) for _, _, rows in found], [4, 1])

    def test_summary_ranks_instructions_and_regions(self):
        name, header, rows = ncu_hot.kernels(csv.reader(io.StringIO(self.text)))[0]
        lines = ncu_hot.summary(name, header, rows, top=2).splitlines()
        self.assertEqual(lines[1].split()[:2], ["100", "warp"])
        # Reasons as shares of all samples; "Not Issued" columns are left out.
        self.assertIn("barrier 55.0%", lines[2])
        self.assertIn("long_sb 17.0%", lines[2])
        self.assertNotIn("Not Issued", lines[2])
        # The two hottest instructions, hottest first, with their counts and main reason.
        self.assertEqual(lines[4].split()[:3], ["60.0%", "1000", "WARPGROUP.DEPBAR.LE"])
        self.assertTrue(lines[4].rstrip().endswith("barrier"))
        self.assertEqual(lines[5].split()[:3], ["20.0%", "1000", "FFMA"])
        # Regions by execution count: the loop's 90% first, its opcodes counted without predicates.
        self.assertIn("90.0%  executed       1000: 3 instructions", lines[7])
        self.assertIn("BRA 1", lines[7])
        self.assertIn("10.0%  executed         10: 1 instructions (STG.E.128 1)", lines[8])

    def test_main_reports_a_file_without_counters(self):
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write("nothing here\n")
        try:
            self.assertEqual(ncu_hot.main(["ncu_hot.py", f.name]), 1)
        finally:
            os.unlink(f.name)


if __name__ == "__main__":
    unittest.main()
