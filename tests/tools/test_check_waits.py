"""tools/check-waits on small trees: loops that poll memory without reading %globaltimer are found, the
bounded ones, the callers of bounded waits, asm statements and comments are not."""
import source_checks

check_waits = source_checks.load("check-waits")


def found(text, name="kernels/k.cu"):
    return source_checks.violations(check_waits, {name: text})


def test_unbounded_loops():
    v = found("__device__ void f(int* p) {\n  while (ld_acquire(p) < 3) {\n    __nanosleep(64);\n  }\n}\n")
    assert len(v) == 1 and "k.cu:2:" in v[0] and "ld_acquire" in v[0]
    assert len(found("__device__ void f(int* p) { while (ld_relaxed(p) == 0); }\n")) == 1
    assert len(found("__device__ void f(int* p) {\n  do {\n  } while (*(volatile int*)p == 0);\n}\n")) == 1
    assert len(found("__device__ void f(const uint32_t* c) { for (;;) { if (signal_load(c) > 1) break; } }\n")) == 1
    # After a digit separator (an odd count of them in 10'000'000'000), the code is still read as code.
    assert len(found("constexpr long kNs = 10'000'000'000;\n__device__ void f(int* p) { while (ld_acquire(p) < 3) {} }\n")) == 1
    assert len(found("__device__ bool f(uint64_t* b) { while (!mbarrier_try_wait(b, 0)) {} return true; }\n",
                     "device/sm90.cuh")) == 1


def test_bounded_and_other_loops():
    bounded = ("__device__ bool f(int* p) {\n  const uint64_t start = globaltimer_ns();\n"
               "  for (;;) {\n    if (ld_acquire(p) > 0) return true;\n"
               "    if (globaltimer_ns() - start > 100) return false;\n  }\n}\n")
    assert found(bounded) == []
    # Calling the bounded waits, an asm statement, a mention in a comment or a string: no poll of its own.
    assert found("__device__ void f(uint64_t* b) { for (int i = 0; i < 4; ++i) mbarrier_wait(b, i, 0, 0, 0); }\n") == []
    asm = "__device__ void f(float* d) { for (int i = 0; i < 4; ++i) asm volatile(\"\" : \"+f\"(d[i])); }\n"
    assert found(asm) == []
    assert found("__device__ void f() {\n  for (int i = 0; i < 4; ++i) {\n    // ld_acquire(p) would wait\n"
                 "    g(\"volatile\");\n  }\n}\n") == []


def test_this_tree():
    assert check_waits.violations(source_checks.TOOLS.parent) == []


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    print("ok")
