"""The table of tools/gpu-traffic from Nsight Compute's text output: per expert GEMM mode, the metrics of
its last launch (ms, GB)."""
import re
import sys

NAMES = {
    "gpu__time_duration.sum": "ms",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "lts__t_bytes.sum": "l2",
    "lts__t_sectors_srcunit_ltcfabric.sum": "fabric",
}
SCALE = {  # to ms for durations, to GB for bytes and sectors
    "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3, "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3,
    "byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3,
    "sector": 32e-9, "Ksector": 32e-6, "Msector": 32e-3, "Gsector": 32.0,
}
MODES = {"0": "gate/up+SwiGLU", "1": "rows (down)", "2": "rows, N-major B", "3": "weight grad"}


def last_launch_per_mode(text):
    last, current = {}, None
    for line in text.splitlines():
        m = re.search(r"expert_gemm_kernel<(?:\(lynx::fused::<unnamed>::Mode\))?(\d)>", line)
        if m and re.match(r"\s+\S", line):
            current = {}
            last[m.group(1)] = current
            continue
        parts = line.split()
        if current is not None and len(parts) >= 3 and parts[0] in NAMES:
            if parts[1] not in SCALE:
                raise ValueError(f"unknown unit {parts[1]!r} in: {line.strip()}")
            current[NAMES[parts[0]]] = float(parts[-1].replace(",", "")) * SCALE[parts[1]]
    return last


def table(last):
    rows = ["mode                     ms   DRAM read GB  DRAM write GB   L2 GB  fabric GB"]
    for mode in sorted(last):
        v = last[mode]
        rows.append(f"{mode} {MODES.get(mode, '?'):18s} {v.get('ms', float('nan')):7.3f}  {v.get('dram_read', float('nan')):12.2f}  "
                    f"{v.get('dram_write', float('nan')):13.2f}  {v.get('l2', float('nan')):6.1f}  {v.get('fabric', float('nan')):9.2f}")
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        last = last_launch_per_mode(f.read())
    if not last:
        print("no expert GEMM launch found")
        sys.exit(1)
    print(table(last))
