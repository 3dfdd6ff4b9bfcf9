"""CPU test of tools/traffic_table.py (the table of tools/gpu-traffic) on a made-up ncu listing."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from traffic_table import last_launch_per_mode, table  # noqa: E402


def launch(mode, ms, read_gb):
    return [f"  void lynx::fused::<unnamed>::expert_gemm_kernel<(lynx::fused::<unnamed>::Mode){mode}>(CUtensorMap_st, "
            "lynx::fused::<unnamed>::Params) (132, 1, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0",
            "    Metric Name    Metric Unit Metric Value",
            f"    gpu__time_duration.sum   ms   {ms}",
            f"    dram__bytes_read.sum   Gbyte   {read_gb}",
            "    lts__t_sectors_srcunit_ltcfabric.sum   sector   31,250,000",
            "    lts__throughput.avg.pct_of_peak_sustained_elapsed   %   90.54"]


class TrafficTable(unittest.TestCase):
    def test_last_launch_of_each_mode(self):
        text = "\n".join(launch(0, 5.3, 20.1) + launch(1, 2.4, 7.7) + launch(0, 5.2, 19.6) + launch(1, 2.3, 7.7))
        last = last_launch_per_mode(text)
        self.assertEqual(sorted(last), ["0", "1"])
        self.assertAlmostEqual(last["0"]["ms"], 5.2)
        self.assertAlmostEqual(last["0"]["dram_read"], 19.6)
        self.assertAlmostEqual(last["0"]["fabric"], 1.0)  # 31.25 M sectors of 32 bytes
        self.assertAlmostEqual(last["0"]["l2_busy"], 90.54)  # a percentage stays one
        lines = table(last).splitlines()
        self.assertTrue(lines[1].startswith("0 gate/up+SwiGLU"))
        self.assertIn("19.60", lines[1])
        self.assertIn("90.5", lines[1])

    def test_microseconds_and_unknown_units(self):
        text = "\n".join(launch(1, 1, 1)).replace("ms   1", "us   850.5")
        self.assertAlmostEqual(last_launch_per_mode(text)["1"]["ms"], 0.8505)
        with self.assertRaises(ValueError):
            last_launch_per_mode(text.replace("Gbyte", "Pbyte"))


if __name__ == "__main__":
    unittest.main()
