#!/usr/bin/env python3
"""Where a kernel's warps are, instruction by instruction, from Nsight Compute's source page.
Reads `ncu -i REPORT --page source --csv --print-source sass` (one block per profiled kernel, each
headed by a "Kernel Name" row, then a header row starting with "Address") and prints for each kernel:
its warp samples, their split by stall reason, the instructions with the most samples (with how often
each ran and its two main reasons), and the samples by execution count: instructions that ran equally
often make one region (a K-block loop, an epilogue, ...), and its instruction mix says what it issues.
  usage: python3 tools/ncu_hot.py SOURCE_CSV [--top N]"""
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(rows):
    """[(name, header, instruction rows)] from the CSV's rows."""
    found, header = [], None
    for row in rows:
        if row and row[0] == "Kernel Name":
            found.append((row[1] if len(row) > 1 else "", None, []))
            header = None
        elif row and row[0] == "Address" and found:
            header = row
            found[-1] = (found[-1][0], header, found[-1][2])
        elif found and header is not None and len(row) == len(header):
            found[-1][2].append(row)
    return [k for k in found if k[1] is not None]


def number(text):
    text = text.replace(",", "").strip()
    return float(text) if text else 0.0


def opcode(source):
    """The instruction's opcode: its first word past a predicate (`@P0`, `@!P1`)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def summary(name, header, rows, top):
    at = {n: i for i, n in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    total = sum(number(r[at[SAMPLES]]) for r in rows) or 1.0
    out = [f"== {name[:110]}", f"   {int(total)} warp samples, {len(rows)} instructions"]
    by_reason = {n: sum(number(r[at[n]]) for r in rows) for n in reasons}
    out.append("   by reason: " + ", ".join(f"{n[6:]} {100 * v / total:.1f}%"
                                            for n, v in sorted(by_reason.items(), key=lambda x: -x[1])[:8] if v))
    out.append("   hottest instructions (% of samples, times executed, instruction, main reasons):")
    for r in sorted(rows, key=lambda r: -number(r[at[SAMPLES]]))[:top]:
        main = sorted(((number(r[at[n]]), n[6:]) for n in reasons), reverse=True)[:2]
        why = " ".join(n for v, n in main if v)
        out.append(f"   {100 * number(r[at[SAMPLES]]) / total:5.1f}%  {int(number(r[at[EXECUTED]])):>10}  "
                   f"{r[at['Source']].strip()[:64]:64s} {why}")
    out.append("   by times executed (a region: instructions run equally often):")
    regions = collections.defaultdict(list)
    for r in rows:
        regions[int(number(r[at[EXECUTED]]))].append(r)
    ranked = sorted(regions.items(), key=lambda kv: -sum(number(r[at[SAMPLES]]) for r in kv[1]))
    for executed, members in ranked[:6]:
        share = sum(number(r[at[SAMPLES]]) for r in members) / total
        mix = collections.Counter(opcode(r[at["Source"]]) for r in members).most_common(6)
        out.append(f"   {100 * share:5.1f}%  executed {executed:>10}: {len(members)} instructions ("
                   + ", ".join(f"{op} {n}" for op, n in mix) + ")")
    return "\n".join(out)


def main(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    top = 20
    if "--top" in argv:
        top = int(argv[argv.index("--top") + 1])
    with open(argv[1], newline="") as f:
        found = kernels(csv.reader(f))
    if not found:
        print(f"ncu_hot: no kernel's source counters in {argv[1]}", file=sys.stderr)
        return 1
    print("\n".join(summary(name, header, rows, top) for name, header, rows in found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
