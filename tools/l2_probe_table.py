"""The table of tools/gpu-l2-probe from its Nsight Compute text output: per launch of two_readers
(block 0 reads a buffer, then block j re-reads it in the same kernel), the second reader's SM and the
launch's L2 fabric and DRAM traffic; then the SMs split in two at the largest gap in fabric traffic,
which is the L2 partition map when the gap is clear (about half the buffer against all of it)."""
import re
import sys

import ncu_text

NAMES = {
    "lts__t_sectors_srcunit_tex.sum": "tex",
    "lts__t_sectors_srcunit_ltcfabric.sum": "fabric",
    "lts__t_sectors_srcunit_ltcfabric_lookup_miss.sum": "fabric_miss",
    "dram__bytes_read.sum": "dram",
}
READERS = re.compile(r"launch (\d+): first reader SM (\d+), second reader SM (\d+)(.*)")


def launches(text):
    """Per two_readers launch, its traffic in MB."""
    return [{k: v / 1e6 for k, v in run.items()} for _, run in ncu_text.launches(text, r"two_readers\(", NAMES)]


def readers(text):
    return [(int(m.group(1)), int(m.group(2)), int(m.group(3)), "not valid" not in m.group(4))
            for m in map(READERS.match, text.splitlines()) if m]


def table(runs, who):
    rows = ["launch  first SM  second SM  fabric MB  fabric miss MB  DRAM MB"]
    if len(runs) != len(who):
        rows.append(f"warning: {len(runs)} profiled launches but {len(who)} program lines: paired in order")
    firsts = {first for _, first, _, _ in who}
    if len(firsts) > 1:
        rows.append(f"warning: block 0 ran on several SMs ({sorted(firsts)}): the split mixes references")
    points = []
    for run, (j, first, second, valid) in zip(runs, who):
        rows.append(f"{j:6d}  {first:8d}  {second:9d}  {run.get('fabric', float('nan')):9.1f}  "
                    f"{run.get('fabric_miss', float('nan')):14.1f}  {run.get('dram', float('nan')):7.1f}"
                    + ("" if valid else "  (not valid: the second reader timed out)"))
        if valid and "fabric" in run:
            points.append((run["fabric"], second, first))
    if len(points) >= 2:
        points.sort()
        gaps = [(points[i + 1][0] - points[i][0], i) for i in range(len(points) - 1)]
        gap, at = max(gaps)
        near = sorted(p[1] for p in points[: at + 1])
        far = sorted(p[1] for p in points[at + 1:])
        rows.append(f"largest gap in fabric traffic: {gap:.1f} MB, between {points[at][0]:.1f} and "
                    f"{points[at + 1][0]:.1f} MB")
        rows.append(f"with the first reader's SM (less fabric): {' '.join(map(str, near))}")
        rows.append(f"the other side (more fabric): {' '.join(map(str, far))}")
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        text = f.read()
    print(table(launches(text), readers(text)))
