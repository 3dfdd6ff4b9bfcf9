"""Nsight Compute's text output with --metrics: one block per profiled launch, a header line naming the
kernel, then `metric unit value` lines. Shared by tools/l2_probe_table.py and tools/traffic_table.py."""
import re

# To bytes (bytes and 32-byte sectors), to milliseconds (durations), or percentages as they are.
TO_BASE = {
    "%": 1,
    "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "sector": 32, "Ksector": 32e3, "Msector": 32e6, "Gsector": 32e9,
    "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3,
    "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3,
}


def launches(text, header, names):
    """[(header match, {short name: value in bytes or ms})] for every launch whose header line (an
    indented line) matches the regex `header`; `names` maps metric names to short names. Metric lines
    before the first such header are skipped; an unknown unit is an error, not a silent factor of 1."""
    runs, current = [], None
    for line in text.splitlines():
        m = re.search(header, line) if re.match(r"\s+\S", line) else None
        if m:
            current = {}
            runs.append((m, current))
            continue
        parts = line.split()
        if current is not None and len(parts) >= 3 and parts[0] in names:
            if parts[1] not in TO_BASE:
                raise ValueError(f"unknown unit {parts[1]!r} in: {line.strip()}")
            current[names[parts[0]]] = float(parts[-1].replace(",", "")) * TO_BASE[parts[1]]
    return runs
