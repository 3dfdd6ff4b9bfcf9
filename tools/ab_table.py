"""The table of tools/gpu-ab: each build's median time, its ratio to the first and the rounds it won.
From the lynx-bench JSON of every build and round, per (shape, routing, pass): the median of each
build's rounds, its ratio to the first build, and in how many rounds it was the faster of the two. The builds run in turn within a round, so a round compares them at about the
same clock: a build faster in every round is a stronger sign than the medians alone.
  usage: python3 tools/ab_table.py WORK OUT ROUNDS DIR_A DIR_B [DIR ...]
  reads WORK/<build index>-<round>.json, writes OUT/ab.json (every run, with its build and round)"""
import json
import os
import statistics
import sys

PASSES = ["forward", "backward", "forward+backward"]


def pass_label(row):
    """The row's pass (with --precision fp8, what it timed: "forward fp8", ...), with its clock regime
    where lynx-bench timed one (--regime burst|sustained)."""
    regime = row.get("regime", "as-found")
    name = row["pass"] if "pass" in row else row["what"]
    return name if regime == "as-found" else f"{name} {regime}"


def collect(runs):
    """runs: (build index, round, lynx-bench JSON dict). Returns {(shape, routing, pass): {build:
    {round: ms}}} (routing "-" where the rows name none: --precision fp8 times the first routing)."""
    times = {}
    for build, rnd, run in runs:
        for row in run["results"]:
            key = (row["shape"], row.get("routing", "-"), pass_label(row))
            times.setdefault(key, {}).setdefault(build, {})[rnd] = row["ms"]
    return times


def digests(runs, names):
    """With --precision fp8, lynx-bench's digests of every FP8 output's bits (and with bf16 weight
    gradients): one line per build and shape, saying whether they are the first build's. Builds that
    compute the same values give the same digests; empty without such rows."""
    seen = {}
    for build, _, run in runs:
        for row in run["results"]:
            if "fp8_bits" in row:
                seen.setdefault(row["shape"], {}).setdefault(build, set()).add(
                    (row["fp8_bits"], row.get("fp8_bf16_wgrad_bits", "")))
    lines = []
    for shape in sorted(seen):
        first = seen[shape].get(0)
        for build in sorted(seen[shape]):
            bits = seen[shape][build]
            text = ", ".join("/".join(b for b in pair if b) for pair in sorted(bits))
            same = "" if build == 0 else (" (the first build's)" if bits == first else " (DIFFERS from the first build's)")
            lines.append(f"FP8 output bits, {shape}, {names[build]}: {text}{same}")
    return lines


def table(times, names):
    """One line per (shape, routing, pass): the medians, each later build's ratio to the first, and
    'w/n': the rounds it was faster than the first build in, of the n rounds both ran."""
    short = [n[len("build-"):] if n.startswith("build-") else n for n in names]
    width = max([17] + [len(k[2]) for k in times])  # the pass column ("fwd+bwd fp8, bf16 wgrad" is 23)
    head = (f"{'shape':15} {'routing':8} {'pass':{width}} " + " ".join(f"{n[:9]:>9}" for n in short) + " " +
            " ".join(f"{n[:6] + '/A':>8} {'faster':>6}" for n in short[1:]))
    lines = [head]
    order = lambda k: (k[0], k[1], PASSES.index(k[2]) if k[2] in PASSES else len(PASSES))
    for key in sorted(times, key=order):
        by_build = times[key]
        med = [statistics.median(by_build[b].values()) if b in by_build else None for b in range(len(names))]
        cells = " ".join(f"{v:9.3f}" if v is not None else f"{'-':>9}" for v in med)
        others = []
        first = by_build.get(0, {})
        for b in range(1, len(names)):
            rounds = by_build.get(b, {})
            both = [r for r in rounds if r in first]
            wins = sum(1 for r in both if rounds[r] < first[r])
            ratio = f"{med[b] / med[0]:8.3f}" if med[b] is not None and med[0] else f"{'-':>8}"
            others.append(f"{ratio} {f'{wins}/{len(both)}':>6}")
        lines.append(f"{key[0]:15} {key[1]:8} {key[2]:{width}} {cells} " + " ".join(others))
    return "\n".join(lines)


def labels(dirs):
    """The builds' names: each folder's base name, and a repeated one (gpu-ab --control runs the first
    build again as the control) as "NAME-control", "NAME-control2", ..."""
    names, seen = [], {}
    for d in dirs:
        name = os.path.basename(d.rstrip("/"))
        n = seen.get(name, 0)
        seen[name] = n + 1
        names.append(name if n == 0 else f"{name}-control" + (str(n) if n > 1 else ""))
    return names


def main(argv):
    work, out, rounds, dirs = argv[1], argv[2], int(argv[3]), argv[4:]
    runs, raw = [], []
    for i, d in enumerate(dirs):
        for r in range(1, rounds + 1):
            path = os.path.join(work, f"{i}-{r}.json")
            if not os.path.exists(path):
                continue
            # NOTES: a lynx-bench built before 29590f0 that failed part-way (out of memory, a trap) left its
            # JSON unfinished: that round is left out and said so. Later ones write whole files, with
            # "complete": false until the run ends: their finished rows count.
            try:
                with open(path) as f:
                    run = json.load(f)
            except (OSError, ValueError) as e:
                print(f"ab_table: {d} round {r}: {path} unreadable ({e}): left out", file=sys.stderr)
                continue
            if run.get("complete") is False:
                print(f"ab_table: {d} round {r}: the run stopped part-way; its finished rows are used",
                      file=sys.stderr)
            runs.append((i, r, run))
            raw.append({"build": d, "round": r, **run})
    with open(os.path.join(out, "ab.json"), "w") as f:
        json.dump(raw, f, indent=1)
    names = labels(dirs)
    print(table(collect(runs), names))
    for line in digests(runs, names):
        print(line)


if __name__ == "__main__":
    main(sys.argv)
