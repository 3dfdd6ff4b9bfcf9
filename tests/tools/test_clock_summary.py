"""CPU test of tools/clock_summary.py (the clock line of tools/gpu-clocks), on made-up samples."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from clock_summary import summarise  # noqa: E402


class ClockSummary(unittest.TestCase):
    def test_busy_samples_and_decoded_reasons(self):
        lines = [
            "345, 76.5, 0x0000000000000001",  # idle: left out
            "1980, 390.0, 0x0000000000000000",
            "1545, 440.0, 0x0000000000000004",
            "1590, 430.0, 0x000000000000000C",
            "1965, 385.0, 0x0000000000000000",
        ]
        line = summarise(lines)
        self.assertIn("4 busy samples", line)
        self.assertIn("min 1545 median 1778 max 1980", line)
        self.assertIn("below 1800 in 50%", line)
        self.assertIn("power W median 410 max 440", line)
        self.assertIn("SwPowerCap 50%", line)
        self.assertIn("HwSlowdown 25%", line)
        self.assertNotIn("GpuIdle", line)

    def test_unreadable_output_is_reported_not_hidden(self):
        line = summarise(["Field \"clocks_event_reasons.active\" is not a valid field to query.", ""])
        self.assertEqual(line, "clocks: no busy samples (2 unreadable lines)")

    def test_unreadable_power_keeps_the_clock(self):
        line = summarise(["1700, [N/A], 0x4"])
        self.assertIn("1 busy samples: SM MHz min 1700", line)
        self.assertIn("power not readable", line)

    def test_power_limit(self):
        self.assertIn("power W median 300 max 300 of a 700 W limit", summarise(["1980, 300.0, 0x0"], "700.00"))
        self.assertIn("power W median 300 max 300; reasons", summarise(["1980, 300.0, 0x0"], "[N/A]"))

    def test_no_reasons(self):
        self.assertIn("reasons: none", summarise(["1980, 300.0, 0x0"]))


if __name__ == "__main__":
    unittest.main()
