// Turns CUDA runtime and cuBLAS failures into lynx::Error.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "lynx/error.h"

namespace lynx::detail {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw Error("", std::string(what) + " failed: " + cudaGetErrorString(err) + " (" + file + ":" + std::to_string(line) + ")");
}

[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* what, const char* file, int line) {
  throw Error("", std::string(what) + " failed: " + cublasGetStatusString(st) + " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace lynx::detail

#define LYNX_CUDA(call)                                                                            \
  do {                                                                                             \
    cudaError_t lynx_err_ = (call);                                                                \
    if (lynx_err_ != cudaSuccess) ::lynx::detail::throw_cuda(lynx_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define LYNX_CUBLAS(call)                                                                                   \
  do {                                                                                                      \
    cublasStatus_t lynx_st_ = (call);                                                                       \
    if (lynx_st_ != CUBLAS_STATUS_SUCCESS) ::lynx::detail::throw_cublas(lynx_st_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports launch-configuration errors at once.
#define LYNX_CHECK_LAUNCH() LYNX_CUDA(cudaGetLastError())
