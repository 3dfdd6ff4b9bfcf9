#include "common/kernel_loading.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "lynx/error.h"

namespace lynx {
namespace {

struct DriverCalls {
  PFN_cuFuncGetModule_v11000 func_get_module = nullptr;
  PFN_cuModuleGetFunctionCount_v12040 function_count = nullptr;
  PFN_cuModuleEnumerateFunctions_v12040 enumerate_functions = nullptr;
  PFN_cuFuncLoad_v12040 func_load = nullptr;
};

template <class Fn>
Fn entry_point(const char* name, int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    throw Error("", std::string("the CUDA driver does not provide ") + name + " (loading kernels needs driver >= 12.4)");
  }
  return reinterpret_cast<Fn>(p);
}

const DriverCalls& driver() {
  static const DriverCalls calls = [] {
    DriverCalls c;
    c.func_get_module = entry_point<PFN_cuFuncGetModule_v11000>("cuFuncGetModule", 11000);
    c.function_count = entry_point<PFN_cuModuleGetFunctionCount_v12040>("cuModuleGetFunctionCount", 12040);
    c.enumerate_functions = entry_point<PFN_cuModuleEnumerateFunctions_v12040>("cuModuleEnumerateFunctions", 12040);
    c.func_load = entry_point<PFN_cuFuncLoad_v12040>("cuFuncLoad", 12040);
    return c;
  }();
  return calls;
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) throw Error("", std::string("loading kernels: ") + what + " failed (CUresult " + std::to_string(int(r)) + ")");
}

}  // namespace

void load_module_of(const void* kernel) {
  const DriverCalls& d = driver();
  cudaFunction_t function = nullptr;
  LYNX_CUDA(cudaGetFuncBySymbol(&function, kernel));
  CUmodule module = nullptr;
  check(d.func_get_module(&module, reinterpret_cast<CUfunction>(function)), "cuFuncGetModule");
  unsigned count = 0;
  check(d.function_count(&count, module), "cuModuleGetFunctionCount");
  std::vector<CUfunction> functions(count);
  if (count > 0) check(d.enumerate_functions(functions.data(), count, module), "cuModuleEnumerateFunctions");
  for (CUfunction f : functions) check(d.func_load(f), "cuFuncLoad");
}

}  // namespace lynx
