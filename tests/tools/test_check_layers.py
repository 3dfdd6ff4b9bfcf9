"""tools/check-layers on small trees: each kind of include against the layers is found, the allowed
ones are not."""
import source_checks

check_layers = source_checks.load("check-layers")


def found(files):
    return source_checks.violations(check_layers, files)


def test_allowed():
    assert found({
        "runtime/a.cpp": '#include "kernels/glue/api.h"\n#include "plan/layer_plan.h"\n#include "lynx/moe.h"\n',
        "kernels/glue/glue.cu": '#include "kernels/schedule/core.h"\n#include "device/sm90.cuh"\n',
        "experiments/t.h": '#include "runtime/workspace.h"\n#include "api/x.h"\n',
        "reference/r.h": '#include "common/bf16.h"\n',
    }) == []


def test_upward():
    v = found({"kernels/glue/glue.cu": '#include "runtime/workspace.h"\n'})
    assert len(v) == 1 and "higher layer runtime" in v[0]
    v = found({"device/sm90.cuh": '#include "plan/tiles.h"\n'})
    assert len(v) == 1 and "higher layer plan" in v[0]


def test_kernel_internals():
    v = found({"plan/tiles.h": '#include "kernels/expert_gemm/tile_scheduler.h"\n'})
    assert len(v) == 1 and "api.h" in v[0]


def test_reference():
    assert len(found({"runtime/a.cpp": '#include "reference/reference.h"\n'})) == 1
    assert len(found({"reference/r.h": '#include "runtime/workspace.h"\n'})) == 1


def test_unknown_folder():
    assert len(found({"api/a.cpp": '#include "fused/forward.h"\n'})) == 1


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    print("ok")
