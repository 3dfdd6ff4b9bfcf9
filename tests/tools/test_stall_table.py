"""CPU test of tools/stall_table.py (the table of tools/gpu-stalls) on a made-up Nsight Compute source page."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from stall_table import classify, opcode, parse, table  # noqa: E402

CSV = '''==PROF== Connected to process
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x1b90","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;","600","550"
"0x1ba0","@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R5 ;","250","250"
"0x1bb0","BAR.SYNC.DEFER_BLOCKING R4, 0x80 ;","100","100"
"0x1bc0","STS [R153], R10 ;","40","20"
"0x1bd0","FFMA R0, -R7, R8, R88 ;","10","5"
'''


class StallTable(unittest.TestCase):
    def test_opcode_skips_the_predicate(self):
        self.assertEqual(opcode("@!P0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R0+URZ], RZ ;"), "SYNCS.ARRIVE.TRANS64.RED.A1T0")
        self.assertEqual(opcode("  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;"), "HGMMA.64x128x16.F32.BF16")

    def test_classes(self):
        self.assertEqual(classify("WARPGROUP.DEPBAR.LE"), "wgmma wait/fence")
        self.assertEqual(classify("BAR.SYNC.DEFER_BLOCKING"), "named barrier")
        self.assertEqual(classify("MUFU.EX2"), "special function")
        self.assertEqual(classify("FENCE.VIEW.ASYNC.S"), "fence/membar")
        self.assertEqual(classify("IMAD"), "other")

    def test_shares_by_class_and_top_instructions(self):
        rows = parse(CSV)
        self.assertEqual(len(rows), 5)
        lines = table(rows, top=2).splitlines()
        self.assertEqual(lines[1].split(), ["wgmma", "600", "60.0%"])
        self.assertEqual(lines[2].split(), ["mbarrier", "wait/arrive", "250", "25.0%"])
        self.assertIn("named barrier", lines[3])
        top = lines[lines.index("top 2 instructions by samples:") + 1]
        self.assertTrue(top.split()[0] == "0x1b90" and "HGMMA" in top)

    def test_no_header_is_an_error(self):
        with self.assertRaises(ValueError):
            parse("nothing here\n")


if __name__ == "__main__":
    unittest.main()
