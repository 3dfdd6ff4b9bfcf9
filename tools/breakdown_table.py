"""The table of tools/gpu-breakdown: what each stage costs within its pass.
From lynx-bench JSON files of the same passes run in full and with each stage left out (LYNX_OMIT,
src/runtime/stages.h), over alternating rounds: the median of the full pass less the median of the pass
without the stage. The variant "glue" leaves out every glue stage at once (GLUE), so its row says what
the GEMM launches alone take, in each pass and in the forward+backward."""
import json
import statistics
import sys

FORWARD = ["gather", "shared", "gate_up", "down", "combine"]
BACKWARD = ["dy_gather", "dgrad_down", "swiglu_bwd", "dgrad_gate_up", "dx_combine", "x_gather", "wgrad_gate_up",
            "wgrad_down", "shared_bwd"]
FULL = "none"
GLUE = "glue"  # tools/gpu-breakdown: LYNX_OMIT=gather,combine,dy_gather,swiglu_bwd,dx_combine,x_gather


def collect(runs):
    """runs: (variant, lynx-bench JSON text) pairs, the variant "none" or a stage name. Returns
    {(shape, routing, pass): {variant: [ms, ...]}}."""
    times = {}
    for variant, text in runs:
        for r in json.loads(text)["results"]:
            times.setdefault((r["shape"], r["routing"], r["pass"]), {}).setdefault(variant, []).append(r["ms"])
    return times


def table(times):
    """Per shape and routing: the forward's stages against the forward, the backward's against the
    backward, and the glue variant against each of the two and against the forward+backward; the full
    pass's median and range over the rounds show the noise."""
    rows = []
    for (shape, routing, pass_) in sorted(times):
        stages = {"forward": FORWARD, "backward": BACKWARD, "forward+backward": []}.get(pass_)
        variants = times[(shape, routing, pass_)]
        if stages is None or FULL not in variants or not (stages or GLUE in variants):
            continue
        full = variants[FULL]
        base = statistics.median(full)
        rows.append(f"{shape} {routing} {pass_}: {base:.3f} ms in full (rounds {min(full):.3f}-{max(full):.3f}, n={len(full)})")
        rows.append("  stage left out      ms without   saved ms   share")
        for stage in stages + [GLUE]:
            if stage not in variants:
                continue
            without = statistics.median(variants[stage])
            saved = base - without
            rows.append(f"  {stage:18s} {without:11.3f} {saved:10.3f} {100 * saved / base:6.1f}%")
    return "\n".join(rows)


def main(paths):
    """paths: files named <variant>-<anything>.json (tools/gpu-breakdown's naming)."""
    runs = []
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        with open(path) as f:
            runs.append((name.split("-", 1)[0], f.read()))
    print(table(collect(runs)))


if __name__ == "__main__":
    main(sys.argv[1:])
