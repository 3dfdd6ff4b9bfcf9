"""CPU test of tools/random_case_dump.py on a small case written here as tests/gpu/case_dump.cpp writes
one: the loader's bf16 decoding, the errors, and the shared-expert term fit naming a token left out."""
import json
import os
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:  # reported as skipped below
    np = None

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))


def bf16_bits(a):
    """float64 values exact in bf16 -> their bf16 bit patterns."""
    return (np.asarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def on_bf16_grid(rng, shape, scale):
    """Random values exact in bf16 (multiples of 1/64, |v| < 4)."""
    return np.round(rng.standard_normal(shape) * scale * 64) / 64


@unittest.skipIf(np is None, "numpy is not installed")
class RandomCaseDump(unittest.TestCase):
    def write_case(self, path, drop_token):
        rng = np.random.default_rng(7)
        T, H, I, E, k, Is = 12, 8, 4, 2, 2, 4
        t = {"x": on_bf16_grid(rng, (T, H), 1), "dy": on_bf16_grid(rng, (T, H), 1),
             "w_gate": on_bf16_grid(rng, (E, I, H), 0.5), "w_up": on_bf16_grid(rng, (E, I, H), 0.5),
             "w_down": on_bf16_grid(rng, (E, H, I), 0.5), "ws_gate": on_bf16_grid(rng, (Is, H), 0.5),
             "ws_up": on_bf16_grid(rng, (Is, H), 0.5), "ws_down": on_bf16_grid(rng, (H, Is), 0.5)}
        sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        g, u = t["x"] @ t["ws_gate"].T, t["x"] @ t["ws_up"].T
        da = t["dy"] @ t["ws_down"]
        dg = da * u * sig(g) * (1 + g * (1 - sig(g)))
        ref = {"ref_dws_gate": dg.T @ t["x"], "ref_dws_up": (da * g * sig(g)).T @ t["x"],
               "ref_dws_down": t["dy"].T @ (g * sig(g) * u)}
        keep = np.arange(T) != drop_token
        got_dws_gate = dg[keep].T @ t["x"][keep]
        y_ref = on_bf16_grid(rng, (T, H), 1)
        y_got = y_ref.copy()
        y_got[3] = -y_ref[3]  # one token's row off (negation is exact in bf16)
        shapes = {"x": (T, H), "dy": (T, H), "w_gate": (E, I, H), "w_up": (E, I, H), "w_down": (E, H, I),
                  "ws_gate": (Is, H), "ws_up": (Is, H), "ws_down": (H, Is)}
        manifest = {"seed": 42, "case": "T=12 H=8 (written by the test)", "tensors": {}}

        def put(name, dtype, value):
            value = np.asarray(value)
            raw = {"bf16": lambda v: bf16_bits(v), "float64": lambda v: v.astype(np.float64),
                   "float32": lambda v: v.astype(np.float32), "int32": lambda v: v.astype(np.int32)}[dtype](value)
            raw.tofile(os.path.join(path, name + ".bin"))
            manifest["tensors"][name] = {"dtype": dtype, "shape": list(value.shape)}

        for name in shapes:
            put(name, "bf16", t[name])
        put("topk_ids", "int32", np.zeros((T, k)))
        put("topk_weights", "float32", np.ones((T, k)))
        put("y", "bf16", y_got)
        put("ref_y", "float64", y_ref)
        for name in ("dx",):
            put(name, "bf16", y_ref)
            put("ref_" + name, "float64", y_ref)
        put("d_topk_weights", "float32", np.ones((T, k)))
        put("ref_d_topk_weights", "float64", np.ones((T, k)))
        for name, shape in (("dw_gate", (E, I, H)), ("dw_up", (E, I, H)), ("dw_down", (E, H, I))):
            put(name, "bf16", np.zeros(shape))
            put("ref_" + name, "float64", np.zeros(shape))
        # The GPU's dws_gate as the reference less one token's term; the dws in float64 (the reader takes
        # the dtype the manifest names), so that the comparison is exact.
        put("dws_gate", "float64", got_dws_gate)
        put("dws_up", "float64", ref["ref_dws_up"])
        put("dws_down", "float64", ref["ref_dws_down"])
        for name, value in ref.items():
            put(name, "float64", value)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        return y_ref, y_got

    def test_loads_and_reports(self):
        from random_case_dump import errors, load, main, shared_terms
        with tempfile.TemporaryDirectory() as path:
            y_ref, y_got = self.write_case(path, drop_token=9)
            manifest, t = load(path)
            self.assertEqual(manifest["seed"], 42)
            np.testing.assert_array_equal(t["y"], y_got)  # bf16 bits decoded exactly
            total, worst = errors(t["y"], t["ref_y"])
            want_total = np.linalg.norm(y_got - y_ref) / np.linalg.norm(y_ref)
            self.assertAlmostEqual(total, want_total)
            row = np.linalg.norm(y_ref[3])
            self.assertAlmostEqual(worst, 2 * row / max(row, 0.1 * np.linalg.norm(y_ref) / np.sqrt(12)))
            self.assertEqual(errors(t["dws_up"], t["ref_dws_up"], whole=True), (0.0, 0.0))
            nan = t["y"].copy()
            nan[0, 0] = np.nan
            self.assertEqual(errors(nan, t["ref_y"]), (float("inf"), float("inf")))
            fits = shared_terms(t)
            token, coef = fits["dws_gate"][0]
            self.assertEqual(token, 9)
            self.assertAlmostEqual(coef, -1.0, delta=0.05)
            self.assertEqual(main([path, "--shared-terms"]), 0)
            self.assertEqual(main([]), 2)


if __name__ == "__main__":
    unittest.main()
