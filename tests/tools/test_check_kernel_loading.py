"""tools/check-kernel-loading on small trees: a kernel file that loads no module, a loader nothing calls, a
call only in a comment and a loader called only from functions that nothing reaches are found; a loader
reached from a constructor, directly or through other functions, from another file or its own, is not."""
import source_checks

check_kernel_loading = source_checks.load("check-kernel-loading")

KERNEL = "__global__ void k() {}\n"
LOADER = "void load_k_kernels() { load_module_of(reinterpret_cast<const void*>(&k)); }\n"


def found(files):
    return source_checks.violations(check_kernel_loading, files)


def test_unloaded_modules():
    v = found({"kernels/a/k.cu": KERNEL})
    assert len(v) == 1 and v[0].startswith("src/kernels/a/k.cu:") and "load_module_of" in v[0]
    # A loader declared in a header and never called; a call only in a comment or a string.
    v = found({"kernels/a/k.cu": KERNEL + LOADER, "kernels/a/api.h": "void load_k_kernels();\n",
               "runtime/w.cpp": "// load_k_kernels();\nconst char* s = \"load_k_kernels();\";\n"})
    assert len(v) == 1 and "load_k_kernels" in v[0] and "nothing under src/ calls it" in v[0]
    # load_module_of outside any function.
    v = found({"kernels/a/k.cu": KERNEL + "static int x = (load_module_of(nullptr), 0);\n"})
    assert len(v) == 1 and "outside" in v[0]


def test_names_and_literals():
    # Loaders of one name in two namespaces: only a::load_kernels is called, so b's module is not loaded.
    two = {"kernels/a/k.cu": "namespace lynx::a {\n__global__ void k() {}\nvoid load_kernels() { load_module_of(&k); }\n}\n",
           "kernels/b/m.cu": "namespace lynx::b {\n__global__ void m() {}\nvoid load_kernels() { load_module_of(&m); }\n}\n",
           "runtime/w.cpp": "Workspace::Workspace() { a::load_kernels(); }\n"}
    v = found(two)
    assert len(v) == 1 and v[0].startswith("src/kernels/b/m.cu:") and "b::load_kernels" in v[0]
    two["runtime/w.cpp"] = "Workspace::Workspace() { a::load_kernels();\n  b :: load_kernels(); }\n"
    assert found(two) == []
    # A declaration whose return type is on the line before is no call.
    v = found({"kernels/a/k.cu": KERNEL + LOADER, "kernels/a/api.h": "void\nload_k_kernels();\n"})
    assert len(v) == 1 and "nothing under src/ calls it" in v[0]
    # A digit separator opens no character literal: the call after it is code, the one in the comment not.
    sep = "constexpr long kNs = 10'000; // don't\nWorkspace::Workspace() { load_k_kernels(); }\n"
    assert found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": sep}) == []
    assert len(found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": "long n = 1'0; // load_k_kernels();\n"})) == 1
    # Every loader of a file is checked, not only the first.
    second = KERNEL + LOADER + "__global__ void k2() {}\nvoid load_k2() { load_module_of(&k2); }\n"
    v = found({"kernels/a/k.cu": second, "runtime/w.cpp": "Workspace::Workspace() { load_k_kernels(); }\n"})
    assert len(v) == 1 and "load_k2" in v[0]


def test_loaded_modules():
    assert found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": "Workspace::Workspace() { load_k_kernels(); }\n"}) == []
    # One file's loader calling another's module loader; a loader with a parameter.
    two = {"kernels/a/k.cu": KERNEL + LOADER,
           "kernels/a/m.cu": ("__global__ void m() {}\nvoid load_m(int sms) {\n  load_module_of(&m);\n"
                              "  load_k_kernels();\n}\n"),
           "runtime/w.cpp": "Workspace::Workspace() { load_m(132); }\n"}
    assert found(two) == []
    # Headers and C++ files hold no modules of their own.
    assert found({"kernels/a/k.cuh": KERNEL, "kernels/a/h.cpp": "void f() {}\n"}) == []


def test_reached_only_from_outside_void_functions():
    # Called only from a void function that nothing calls, or from a chain of them: not reached.
    v = found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": "void make() { load_k_kernels(); }\n"})
    assert len(v) == 1 and "load_k_kernels" in v[0] and "no call of it is reached" in v[0]
    chain = "void outer() { inner(); }\nvoid inner() { load_k_kernels(); }\n"
    v = found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": chain})
    assert len(v) == 1 and "no call of it is reached" in v[0]
    # The same chain started by a constructor, and by a function that returns a value.
    assert found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": chain + "Workspace::Workspace() { outer(); }\n"}) == []
    assert found({"kernels/a/k.cu": KERNEL + LOADER, "runtime/w.cpp": chain + "int start() { outer(); return 0; }\n"}) == []
    # Two chains through functions of one name in two namespaces: only a's is started, so b's loader is
    # not reached.
    two = {"kernels/a/k.cu": "namespace lynx::a {\n__global__ void k() {}\nvoid load() { load_module_of(&k); }\n"
                             "void prepare() { a::load(); }\n}\n",
           "kernels/b/m.cu": "namespace lynx::b {\n__global__ void m() {}\nvoid load() { load_module_of(&m); }\n"
                             "void prepare() { b::load(); }\n}\n",
           "runtime/w.cpp": "Workspace::Workspace() { a::prepare(); }\n"}
    v = found(two)
    assert len(v) == 1 and v[0].startswith("src/kernels/b/m.cu:") and "b::load" in v[0]
    two["runtime/w.cpp"] = "Workspace::Workspace() { a::prepare(); b::prepare(); }\n"
    assert found(two) == []


if __name__ == "__main__":
    test_reached_only_from_outside_void_functions()
    test_unloaded_modules()
    test_names_and_literals()
    test_loaded_modules()
    print("ok")
