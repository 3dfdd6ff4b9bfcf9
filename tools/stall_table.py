"""The table of tools/gpu-stalls: from Nsight Compute's source page of one kernel as CSV (`ncu --import
REPORT --page source --csv --print-source sass`), where the warps' sampled cycles went, by class of
SASS instruction (wgmma, its waits, mbarrier waits, named barriers, shared-memory stores, TMA, fences,
special functions, ...), and the instructions that took the most samples. Columns are found by name,
since Nsight Compute versions differ in their order."""
import csv
import io
import re
import sys

# Instruction classes, first match wins: (name, regex on the opcode).
CLASSES = [
    ("wgmma", r"^HGMMA"),
    ("wgmma wait/fence", r"^WARPGROUP\.(DEPBAR|ARRIVE)|^WARPSYNC"),
    ("mbarrier wait/arrive", r"^SYNCS"),
    ("named barrier", r"^BAR\b|^BAR\."),
    ("cluster barrier", r"^UCGABAR"),
    ("smem store", r"^STS|^STSM"),
    ("TMA", r"^UTMA|^UBLKCP|^UTMACCTL"),
    ("fence/membar", r"^FENCE|^MEMBAR|^CCTL"),
    ("special function", r"^MUFU"),
    ("global memory", r"^LDG|^STG|^ATOMG|^REDG|^RED\b|^LD\b|^ST\b"),
    ("branch/sync", r"^BRA|^BSSY|^BSYNC|^CALL|^RET|^EXIT|^NANOSLEEP|^YIELD"),
]


def opcode(source):
    """The opcode of a SASS line such as '@!P0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R0+URZ], RZ ;'."""
    text = source.strip()
    if text.startswith("@"):
        text = text.split(None, 1)[1] if " " in text else ""
    return text.split(None, 1)[0] if text else ""


def classify(op):
    for name, pattern in CLASSES:
        if re.search(pattern, op):
            return name
    return "other"


def column(header, *needles):
    """Index of the first column whose name contains every needle (case-insensitive), else None."""
    for i, name in enumerate(header):
        if all(n.lower() in name.lower() for n in needles):
            return i
    return None


def parse(text):
    """Rows of (address, sass, samples, reasons) from the CSV; samples = all warp-state samples of
    the instruction, reasons = {stall reason: samples} where the page has the `stall_*` columns.
    Lines before the header (Nsight Compute's banner) are skipped."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if "Source" in l and "Sampling" in l), None)
    if start is None:
        raise ValueError("no source-page header with 'Source' and a 'Sampling' column")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    src = column(header, "Source")
    samples = column(header, "Sampling", "All")
    if samples is None:
        samples = column(header, "Sampling")
    address = column(header, "Address")
    reasons = [(i, name[len("stall_"):]) for i, name in enumerate(header)
               if name.startswith("stall_") and "Not Issued" not in name]
    rows = []
    for r in reader:
        if len(r) <= max(src, samples):
            continue
        try:
            n = float(r[samples].replace(",", "") or 0)
        except ValueError:
            continue
        why = {}
        for i, name in reasons:
            try:
                why[name] = float(r[i].replace(",", "") or 0)
            except (ValueError, IndexError):
                pass
        rows.append((r[address] if address is not None else "", r[src], n, why))
    return rows


def row_classes(rows):
    """The class of each row. A branch right after an mbarrier try-wait is that wait's loop, and its
    samples are the wait's, so it takes the wait's class."""
    names = []
    previous = ""
    for _, src, _, _ in rows:
        op = opcode(src)
        name = classify(op)
        if name == "branch/sync" and previous.startswith("SYNCS.PHASECHK"):
            name = classify(previous)
        names.append(name)
        previous = op
    return names


def regions(rows, bucket=0x400, min_share=0.003):
    """Samples by stretch of code: offsets from the kernel's first instruction in buckets of
    `bucket` bytes, with the stretch's busiest opcodes and stall reasons, for buckets above
    `min_share` of all samples. Offsets map onto `cuobjdump -sass` of the same binary."""
    total = sum(n for _, _, n, _ in rows) or 1.0
    try:
        base = int(rows[0][0], 16)
    except (IndexError, ValueError):
        return "no addresses"
    buckets = {}
    for addr, src, n, why in rows:
        try:
            key = (int(addr, 16) - base) // bucket * bucket
        except ValueError:
            continue
        b = buckets.setdefault(key, [0.0, {}, {}])
        b[0] += n
        op = opcode(src).split(".")[0]
        b[1][op] = b[1].get(op, 0.0) + n
        for reason, m in why.items():
            b[2][reason] = b[2].get(reason, 0.0) + m
    out = [f"{'offset':>8} {'share':>6}  busiest opcodes | stall reasons (% of the stretch)"]
    for key in sorted(buckets):
        n, ops, why = buckets[key]
        if n / total < min_share:
            continue
        top_ops = sorted(ops.items(), key=lambda kv: -kv[1])[:4]
        top_why = sorted(why.items(), key=lambda kv: -kv[1])[:3]
        out.append(f"{key:8x} {100 * n / total:5.1f}%  "
                   + " ".join(f"{o}:{100 * v / n:.0f}" for o, v in top_ops) + " | "
                   + " ".join(f"{o}:{100 * v / n:.0f}" for o, v in top_why if v > 0))
    return "\n".join(out)


def table(rows, top=25):
    total = sum(n for _, _, n, _ in rows) or 1.0
    by_class = {}
    for (_, _, n, _), name in zip(rows, row_classes(rows)):
        by_class[name] = by_class.get(name, 0.0) + n
    out = [f"{'class':22} {'samples':>10} {'share':>7}"]
    for name, n in sorted(by_class.items(), key=lambda kv: -kv[1]):
        out.append(f"{name:22} {n:10.0f} {100 * n / total:6.1f}%")
    out.append("")
    out.append(f"top {top} instructions by samples:")
    for addr, src, n, _ in sorted(rows, key=lambda r: -r[2])[:top]:
        out.append(f"{addr:>8} {n:10.0f} {100 * n / total:6.1f}%  {src.strip()[:90]}")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        rows = parse(f.read())
    print(table(rows))
    print()
    print(regions(rows))
