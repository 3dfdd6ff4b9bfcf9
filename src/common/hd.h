// Marks functions that compile for both host and device.
#pragma once

#if defined(__CUDACC__)
#define LYNX_HD __host__ __device__ __forceinline__
#else
#define LYNX_HD inline
#endif
