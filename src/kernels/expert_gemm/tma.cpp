#include "kernels/expert_gemm/tma.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <string>

#include "lynx/error.h"

namespace lynx::gemm {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || p == nullptr) {
      throw Error("", "the CUDA driver does not provide cuTensorMapEncodeTiled (TMA needs driver >= 12.0)");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

CUtensorMap encode(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides_bytes,
                   const cuuint32_t* box, L2Fetch fetch,
                   CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  CUtensorMap map{};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapL2promotion promotion =
      fetch == L2Fetch::k256B ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_NONE;
  const CUresult r = encode_fn()(&map, type, rank, const_cast<void*>(base), dims,
                                 strides_bytes, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    // The map's shape goes into the message: which of the kernels' maps a driver refused.
    const auto list = [](const auto* v, int n) {
      std::string out;
      for (int i = 0; i < n; ++i) out += (i ? ", " : "") + std::to_string(v[i]);
      return "{" + out + "}";
    };
    throw Error("", "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)) + " (bf16, dims " +
                        list(dims, rank) + ", byte strides " + list(strides_bytes, rank - 1) + ", box " +
                        list(box, rank) + ")");
  }
  return map;
}

}  // namespace

CUtensorMap make_tma_2d(const void* base, int64_t rows, int64_t cols, int box_rows, int box_cols) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * 2};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  return encode(base, 2, dims, strides, box, L2Fetch::k256B);
}

CUtensorMap make_tma_2d_bytes(const void* base, int64_t rows, int64_t cols, int box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols)};
  const cuuint32_t box[2] = {128, cuuint32_t(box_rows)};
  return encode(base, 2, dims, strides, box, L2Fetch::k256B, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

CUtensorMap make_tma_3d_bytes(const void* base, int64_t batches, int64_t rows, int64_t cols, int box_rows) {
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(batches)};
  const cuuint64_t strides[2] = {cuuint64_t(cols), cuuint64_t(cols) * cuuint64_t(rows)};
  const cuuint32_t box[3] = {128, cuuint32_t(box_rows), 1};
  return encode(base, 3, dims, strides, box, L2Fetch::k256B, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

CUtensorMap make_tma_2d_chunks(const void* base, int64_t rows, int64_t cols, int box_rows, int chunks) {
  // Dimensions, innermost first: a column within its block, the row, the block (128 bytes apart).
  // NOTES: the block's stride is below the row's. The driver's documentation describes each stride as
  // including the one before; the H200's driver (580) encodes and loads this map as intended (the
  // weight-gradient tests, measured 2026-12-01, commit 88df960). A driver that
  // refused it would make encode() throw with its CUresult, not load wrong data.
  const cuuint64_t dims[3] = {64, cuuint64_t(rows), cuuint64_t(cols / 64)};
  const cuuint64_t strides[2] = {cuuint64_t(cols) * 2, 128};
  const cuuint32_t box[3] = {64, cuuint32_t(box_rows), cuuint32_t(chunks)};
  return encode(base, 3, dims, strides, box, L2Fetch::k256B);
}

CUtensorMap make_tma_3d(const void* base, int64_t batches, int64_t rows, int64_t cols, int box_rows, int box_cols,
                        L2Fetch fetch, int64_t batch_stride) {
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(batches)};
  const cuuint64_t strides[2] = {cuuint64_t(cols) * 2, cuuint64_t(batch_stride > 0 ? batch_stride : cols * rows) * 2};
  const cuuint32_t box[3] = {cuuint32_t(box_cols), cuuint32_t(box_rows), 1};
  return encode(base, 3, dims, strides, box, fetch);
}

}  // namespace lynx::gemm
