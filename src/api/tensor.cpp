#include "lynx/tensor.h"

#include <string>

#include "lynx/error.h"

namespace lynx {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kF32: return "fp32";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kE4M3: return "e4m3";
  }
  return "unknown";
}

// NOTES: a caller's view may hold any rank (an uninitialised one, say): outside [0, kMaxTensorRank] it
// has no elements and is not contiguous, and the shape arrays are never read past their end.
int64_t TensorView::numel() const {
  if (rank < 0 || rank > kMaxTensorRank) return 0;
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  if (rank < 0 || rank > kMaxTensorRank) return false;
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  if (shape.size() > static_cast<size_t>(kMaxTensorRank)) {
    throw Error("make_view", "rank " + std::to_string(shape.size()) + " exceeds the maximum " + std::to_string(kMaxTensorRank));
  }
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int32_t>(shape.size());
  int d = 0;
  for (int64_t s : shape) v.shape[d++] = s;
  int64_t stride = 1;
  for (d = v.rank - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return make_view(const_cast<void*>(data), dtype, shape);
}

}  // namespace lynx
