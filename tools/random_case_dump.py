"""Reads a random case written by LYNX_RANDOM_DUMP=DIR (tests/gpu/case_dump.h: DIR/<seed>/manifest.json and
one raw file a tensor) and prints each output's error against the fp64 reference written beside it: the
relative Frobenius error and the worst row's (a token's row of y, dx and d_topk_weights; an expert's
weight gradient, the shared expert's whole). With --shared-terms, it also fits the error of the shared
expert's weight gradients onto each token's term of them (recomputed in fp64 from the inputs) and names
the tokens that explain most of it: a coefficient near -1 is a token left out, near +1 one counted twice.
Needs numpy. Tested in tests/tools/test_random_case_dump.py.
  usage: python3 tools/random_case_dump.py DIR/<seed> [--shared-terms]"""
import json
import os
import sys

import numpy as np

DTYPES = {"bf16": np.uint16, "int32": np.int32, "float32": np.float32, "float64": np.float64}
OUTPUTS = ["y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down"]


def load(path):
    """The manifest and every tensor, bf16 widened to float64."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    tensors = {}
    for name, info in manifest["tensors"].items():
        raw = np.fromfile(os.path.join(path, name + ".bin"), dtype=DTYPES[info["dtype"]])
        if info["dtype"] == "bf16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.astype(np.float64).reshape(info["shape"])
    return manifest, tensors


def errors(got, want, whole=False):
    """(relative Frobenius error, worst row's relative error) with rows along the first axis (`whole`:
    one row), each row's denominator at least a tenth of the rows' RMS norm (the test's floor, without
    its term scales); NaN in got gives (inf, inf)."""
    if got.size == 0:
        return 0.0, 0.0
    if not np.all(np.isfinite(got)):
        return float("inf"), float("inf")
    n = 1 if whole else got.shape[0]
    rows = got.reshape(n, -1) - want.reshape(n, -1)
    ref = want.reshape(n, -1)
    den = np.linalg.norm(ref)
    total = np.linalg.norm(rows) / den if den > 0 else np.linalg.norm(rows)
    row_den = np.maximum(np.linalg.norm(ref, axis=1), 0.1 * den / np.sqrt(ref.shape[0]))
    worst = np.max(np.linalg.norm(rows, axis=1) / np.where(row_den > 0, row_den, 1.0))
    return float(total), float(worst)


def shared_terms(t, top=5):
    """For dws_gate, dws_up and dws_down: the `top` tokens whose terms best explain the GPU's error, as
    (token, coefficient) pairs (the error's projection on the token's term over the term's square norm)."""
    sigmoid = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    x, dy = t["x"], t["dy"]
    g, u = x @ t["ws_gate"].T, x @ t["ws_up"].T
    da = dy @ t["ws_down"]
    silu = g * sigmoid(g)
    dg = da * u * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    du = da * silu
    a = silu * u
    fits = {}
    for name, left, right in (("dws_gate", dg, x), ("dws_up", du, x), ("dws_down", dy, a)):
        err = t[name] - t["ref_" + name]  # [left cols, right cols]
        proj = np.einsum("ti,ij,tj->t", left, err, right)
        norm = np.sum(left * left, axis=1) * np.sum(right * right, axis=1)
        coef = np.where(norm > 0, proj / np.where(norm > 0, norm, 1.0), 0.0)
        order = np.argsort(-np.abs(coef))[:top]
        fits[name] = [(int(i), float(coef[i])) for i in order]
    return fits


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__.splitlines()[-1].strip(), file=sys.stderr)
        return 2
    manifest, t = load(argv[0])
    print(f"seed {manifest['seed']}: {manifest['case']}")
    for name in OUTPUTS:
        total, worst = errors(t[name], t["ref_" + name], whole=name.startswith("dws"))
        print(f"{name:16s} relative error {total:.2e}, worst row {worst:.2e}")
    if "--shared-terms" in argv[1:] and t["ws_gate"].size:
        for name, fit in shared_terms(t).items():
            print(f"{name}: tokens whose terms explain its error (token, coefficient): {fit}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
