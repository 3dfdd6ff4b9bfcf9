"""CPU test of tools/stall_table.py (the table of tools/gpu-stalls) on a made-up Nsight Compute source page."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from stall_table import classify, opcode, parse, regions, table  # noqa: E402

CSV = '''==PROF== Connected to process
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"
"0x1b90","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;","600","550","0","0","0"
"0x1ba0","@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R5 ;","150","150","0","0","0"
"0x1bb0","@P0 BRA 0x1ba0 ;","100","100","100","0","100"
"0x1bc0","BAR.SYNC.DEFER_BLOCKING R4, 0x80 ;","100","100","0","100","0"
"0x2000","STS [R153], R10 ;","40","20","0","0","0"
"0x2010","FFMA R0, -R7, R8, R88 ;","10","5","0","0","0"
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
        self.assertEqual(len(rows), 6)
        self.assertEqual(rows[2][3], {"long_sb": 100.0, "barrier": 0.0})
        lines = table(rows, top=2).splitlines()
        self.assertEqual(lines[1].split(), ["wgmma", "600", "60.0%"])
        self.assertEqual(lines[2].split(), ["mbarrier", "wait/arrive", "250", "25.0%"])
        self.assertIn("named barrier", lines[3])
        top = lines[lines.index("top 2 instructions by samples:") + 1]
        self.assertTrue(top.split()[0] == "0x1b90" and "HGMMA" in top)

    def test_a_branch_after_a_try_wait_counts_as_the_wait(self):
        lines = table(parse(CSV), top=1).splitlines()
        self.assertEqual(lines[2].split(), ["mbarrier", "wait/arrive", "250", "25.0%"])
        self.assertFalse(any(l.startswith("branch/sync") for l in lines))

    def test_regions_are_offsets_from_the_first_instruction(self):
        lines = regions(parse(CSV), bucket=0x400).splitlines()
        self.assertEqual(len(lines), 3)
        first, second = lines[1].split(), lines[2].split()
        self.assertEqual(first[:2], ["0", "95.0%"])
        self.assertEqual(first[2], "HGMMA:63")
        self.assertIn("long_sb:11", lines[1])
        self.assertEqual(second[:2], ["400", "5.0%"])

    def test_no_header_is_an_error(self):
        with self.assertRaises(ValueError):
            parse("nothing here\n")


if __name__ == "__main__":
    unittest.main()
