"""The table of tools/gpu-l2-probe from Nsight Compute's text output: read_side launches come four per
rule (side 0, side 0 again; side 0, side 1), and for each rule the second read's L2 and DRAM traffic
is shown for the same side and for the other side."""
import re
import sys

NAMES = {
    "lts__t_sectors_srcunit_tex.sum": "tex",
    "lts__t_sectors_srcunit_tex_lookup_miss.sum": "tex_miss",
    "lts__t_sectors_srcunit_ltcfabric.sum": "fabric",
    "lts__t_sectors_srcunit_ltcfabric_lookup_miss.sum": "fabric_miss",
    "dram__bytes_read.sum": "dram",
}
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "sector": 32, "Ksector": 32e3, "Msector": 32e6}


def launches(text):
    runs, current = [], None
    for line in text.splitlines():
        if re.match(r"\s+\S.*read_side\(", line):
            current = {}
            runs.append(current)
            continue
        parts = line.split()
        if current is not None and len(parts) >= 3 and parts[0] in NAMES:
            value = float(parts[-1].replace(",", ""))
            current[NAMES[parts[0]]] = value * UNITS.get(parts[1], 1) / 1e6  # MB
    return runs


def table(runs):
    rows = ["rule  second read by   tex MB  tex miss  fabric MB  fabric miss  DRAM MB"]
    for rule in range(len(runs) // 4):
        for label, run in (("same side", runs[4 * rule + 1]), ("other side", runs[4 * rule + 3])):
            rows.append(f"{rule:4d}  {label:14s} " + " ".join(
                f"{run.get(k, float('nan')):9.1f}" for k in ("tex", "tex_miss", "fabric", "fabric_miss", "dram")))
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(launches(f.read())))
