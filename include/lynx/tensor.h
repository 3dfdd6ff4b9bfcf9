// lynx: non-owning views of device tensors passed across the public API.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace lynx {

// kE4M3: FP8 E4M3 (the OCP format, no infinities), a byte an element: pre-quantised expert weights.
enum class DType : int32_t { kBF16 = 0, kF32 = 1, kI32 = 2, kI64 = 3, kE4M3 = 4 };

constexpr int64_t dtype_size(DType t) {
  return t == DType::kE4M3 ? 1 : t == DType::kBF16 ? 2 : t == DType::kI64 ? 8 : 4;
}
const char* dtype_name(DType t);

constexpr int kMaxTensorRank = 4;

// A strided view: element (i0, i1, ...) lives at data + Σ i_d · strides[d] elements.
// A default-constructed view (data == nullptr, rank == 0) means "absent" (e.g. no shared expert).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  int32_t rank = 0;
  int64_t shape[kMaxTensorRank] = {0, 0, 0, 0};
  int64_t strides[kMaxTensorRank] = {0, 0, 0, 0};

  bool present() const { return data != nullptr; }
  int64_t numel() const;
  bool is_contiguous() const;  // row-major, no padding
};

// A contiguous row-major view of `shape`.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape);
TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape);

}  // namespace lynx
