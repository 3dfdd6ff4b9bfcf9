"""Summarises nvidia-smi clock samples in one line, for tools/gpu-clocks.
The samples are of `clocks.sm, power, clocks_event_reasons.active` (csv, noheader, nounits; power is
power.draw.instant where the driver has it, else power.draw, a one-second average that hides short
peaks); the line gives the SM clock while busy (above 600 MHz), the board power, the enforced power
limit when given, and the clock-event reasons seen, decoded from the NVML bit mask. Tested in
tests/tools/test_clock_summary.py."""
import statistics
import sys

REASONS = {  # nvmlClocksEventReason* bits
    0x1: "GpuIdle",
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}


def summarise(lines, limit=None):
    busy, power, reasons, bad = [], [], {}, 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz, mask = float(parts[0]), int(parts[2], 16)
        except (ValueError, IndexError):
            bad += 1
            continue
        if mhz <= 600:
            continue
        busy.append(mhz)
        try:
            power.append(float(parts[1]))
        except ValueError:  # "[N/A]" on some boards: the clock still counts
            pass
        for bit, name in REASONS.items():
            if mask & bit:
                reasons[name] = reasons.get(name, 0) + 1
    if not busy:
        return f"clocks: no busy samples ({bad} unreadable lines)"
    seen = ", ".join(f"{n} {100 * c / len(busy):.0f}%" for n, c in sorted(reasons.items(), key=lambda x: -x[1]))
    slow = sum(1 for m in busy if m < 1800)
    watts = (f"power W median {statistics.median(power):.0f} max {max(power):.0f}" if power
             else "power not readable")
    try:
        watts += f" of a {float(limit):.0f} W limit"
    except (TypeError, ValueError):  # not given, or "[N/A]"
        pass
    return (f"clocks: {len(busy)} busy samples: SM MHz min {min(busy):.0f} median {statistics.median(busy):.0f} "
            f"max {max(busy):.0f}, below 1800 in {100 * slow / len(busy):.0f}%; {watts}; reasons: {seen or 'none'}")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summarise(f.read().splitlines(), sys.argv[2] if len(sys.argv) > 2 else None))
