"""The table of tools/gpu-traffic from Nsight Compute's text output: per expert GEMM mode, the metrics of
its last launch (ms, GB, % busy)."""
import sys

import ncu_text

NAMES = {
    "gpu__time_duration.sum": "ms",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "lts__t_bytes.sum": "l2",
    "lts__t_sectors_srcunit_ltcfabric.sum": "fabric",
    "lts__t_sectors_srcunit_tex_op_read.sum": "sm_read",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_busy",
    "l1tex__m_xbar2l1tex_read_bytes.sum.pct_of_peak_sustained_elapsed": "xbar_busy",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_busy",
}
PERCENT = {"l2_busy", "xbar_busy", "tensor_busy"}
MODES = {"0": "gate/up+SwiGLU", "1": "rows (down)", "2": "rows, N-major B", "3": "weight grad"}


def last_launch_per_mode(text):
    """Per mode, the metrics of its last launch: ms, and GB for the traffic."""
    header = r"expert_gemm_kernel<(?:\(lynx::fused::<unnamed>::Mode\))?(\d)>"
    return {m.group(1): {k: v if k == "ms" or k in PERCENT else v / 1e9 for k, v in run.items()}
            for m, run in ncu_text.launches(text, header, NAMES)}


def table(last):
    rows = ["mode                     ms   DRAM read GB  DRAM write GB   L2 GB  fabric GB  SM read GB"
            "  L2 busy %  L2->SM busy %  tensor busy %"]
    nan = float("nan")
    for mode in sorted(last):
        v = last[mode]
        rows.append(f"{mode} {MODES.get(mode, '?'):18s} {v.get('ms', nan):7.3f}  {v.get('dram_read', nan):12.2f}  "
                    f"{v.get('dram_write', nan):13.2f}  {v.get('l2', nan):6.1f}  {v.get('fabric', nan):9.2f}  "
                    f"{v.get('sm_read', nan):10.2f}  {v.get('l2_busy', nan):9.1f}  {v.get('xbar_busy', nan):13.1f}  "
                    f"{v.get('tensor_busy', nan):13.1f}")
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        last = last_launch_per_mode(f.read())
    if not last:
        print("no expert GEMM launch found")
        sys.exit(1)
    print(table(last))
