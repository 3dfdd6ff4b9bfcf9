// bf16 transposes that let the backward pass run every GEMM with K-major operands (the layout the
// expert GEMM kernel takes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lynx::fused {

using bf16_t = uint16_t;

// For b < batches, r < rows, c < cols:
//   dst[b * dst_batch_stride + c * dst_row_pitch + r] = src[b * rows * cols + r * cols + c].
// With `rows_total` (device, may be null), only rows r < *rows_total are transposed; with
// `row_token_slot` (may be null), rows whose slot is < 0 (schedule padding) are written as zeros.
void transpose(bf16_t* dst, int64_t dst_row_pitch, int64_t dst_batch_stride, const bf16_t* src, int64_t batches,
               int64_t rows, int64_t cols, const int32_t* rows_total, const int32_t* row_token_slot,
               cudaStream_t stream);

}  // namespace lynx::fused
