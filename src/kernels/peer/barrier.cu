#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "device/remote.cuh"
#include "device/sm90.cuh"
#include "kernels/peer/api.h"

namespace lynx::peer {
namespace {

// One thread per rank.
__global__ void arrive_kernel(const BarrierArgs a, bool publish_status) {
  const int32_t p = threadIdx.x;
  if (p >= a.ranks) return;
  if (publish_status) {
    const int32_t code = *reinterpret_cast<const volatile int32_t*>(&a.status->code);
    remote::store(&a.signals[p]->errors[a.rank], code);
  }
  __threadfence_system();
  remote::signal_add(&a.signals[p]->arrivals[a.rank], 1u);
}

// One thread per rank: thread p waits for rank p (thread 0 also counts the barrier as passed).
__global__ void wait_kernel(const BarrierArgs a, bool collect_errors) {
  const int32_t p = threadIdx.x;
  Signals* own = a.signals[a.rank];
  const uint32_t target = own->passed + 1;
  if (p < a.ranks) {
    const uint32_t* counter = &own->arrivals[p];
    uint32_t seen = remote::signal_load(counter);
    if (int32_t(seen - target) < 0) {
      const uint64_t start = sm90::globaltimer_ns();
      for (;;) {
        __nanosleep(256);
        seen = remote::signal_load(counter);
        if (int32_t(seen - target) >= 0) break;
        if (sm90::globaltimer_ns() - start > a.timeout_ns) {
          sm90::report_stall(a.stall_report, sm90::Wait::kPeerArrival, p, int64_t(seen) - int64_t(target));
        }
      }
    }
    if (collect_errors && p != a.rank) {
      const int32_t code = own->errors[p];
      DeviceStatus* mine = a.status;
      if (code != int32_t(StatusCode::kOk) && code != int32_t(StatusCode::kPeerFailed) &&
          atomicCAS(&mine->code, int32_t(StatusCode::kOk), int32_t(StatusCode::kPeerFailed)) == int32_t(StatusCode::kOk)) {
        mine->rank = a.rank;
        mine->a = p;
        mine->b = code;
        mine->c = 0;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) own->passed = target;
}

}  // namespace

void arrive(const BarrierArgs& args, bool publish_status, cudaStream_t stream) {
  arrive_kernel<<<1, 32 * ((args.ranks + 31) / 32), 0, stream>>>(args, publish_status);
  LYNX_CHECK_LAUNCH();
}

void wait(const BarrierArgs& args, bool collect_errors, cudaStream_t stream) {
  wait_kernel<<<1, 32 * ((args.ranks + 31) / 32), 0, stream>>>(args, collect_errors);
  LYNX_CHECK_LAUNCH();
}

void load_kernels() { load_module_of(reinterpret_cast<const void*>(&arrive_kernel)); }

}  // namespace lynx::peer
