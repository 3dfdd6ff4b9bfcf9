"""The table of tools/gpu-traffic from Nsight Compute's text output: per expert GEMM mode, the metrics of
its last launch (ms, GB)."""
import sys

import ncu_text

NAMES = {
    "gpu__time_duration.sum": "ms",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "lts__t_bytes.sum": "l2",
    "lts__t_sectors_srcunit_ltcfabric.sum": "fabric",
}
MODES = {"0": "gate/up+SwiGLU", "1": "rows (down)", "2": "rows, N-major B", "3": "weight grad"}


def last_launch_per_mode(text):
    """Per mode, the metrics of its last launch: ms, and GB for the traffic."""
    header = r"expert_gemm_kernel<(?:\(lynx::fused::<unnamed>::Mode\))?(\d)>"
    return {m.group(1): {k: v if k == "ms" else v / 1e9 for k, v in run.items()}
            for m, run in ncu_text.launches(text, header, NAMES)}


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
