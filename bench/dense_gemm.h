// The dense bf16 GEMM rate of this GPU, measured in the same run as the layer.
#pragma once

#include "gpu_clock.h"
#include "regime.h"

namespace lynx::bench {

struct DenseRate {
  double tflops;
  ClockSummary clocks;
};

// Median TFLOP/s of an n×n×n bf16 cuBLAS product (fp32 accumulation) on random data, timed in `p`'s
// regime; `clock` may be null.
DenseRate dense_gemm_rate(int n, const Protocol& p, const GpuClock* clock);

}  // namespace lynx::bench
