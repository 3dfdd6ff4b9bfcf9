// One rank of a process group, for the multi-process tests (Processes.*): builds the global test
// layer from its seed, connects through CUDA IPC with an all-gather over files in a folder, runs
// forward and backward on its share and writes its outputs there. With --no-pass it connects and then
// runs nothing (a rank that never arrives), waiting until rank 0 is done. With --gpu-per-rank rank r
// runs on GPU r (of those there are, modulo their count); else every rank on the current one.
//   usage: lynx_rank_process DIR RANK RANKS SEED [--no-pass] [--timeout-ms N] [--fp8] [--gpu-per-rank]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gpu/ranks_check.h"
#include "gpu/rank_process_io.h"
#include "runtime/workspace.h"

namespace fs = std::filesystem;
using namespace lynx;
using namespace lynx::test;

namespace {

std::vector<uint8_t> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Writes `bytes` as DIR/NAME (complete when it appears: written under another name, then renamed).
void publish(const fs::path& dir, const std::string& name, const std::vector<uint8_t>& bytes) {
  const fs::path tmp = dir / (name + ".part");
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  fs::rename(tmp, dir / name);
}

// Waits (at most 60 s) until DIR/NAME exists.
void await_file(const fs::path& dir, const std::string& name) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(dir / name)) {
    if (std::chrono::steady_clock::now() > until) throw std::runtime_error("no " + name + " after 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s DIR RANK RANKS SEED [--no-pass] [--timeout-ms N] [--fp8] [--gpu-per-rank]\n",
                 argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  const int32_t rank = std::atoi(argv[2]), R = std::atoi(argv[3]);
  const uint64_t seed = std::strtoull(argv[4], nullptr, 10);
  bool pass = true;
  int gpus = 0;  // --gpu-per-rank: the GPUs the ranks are spread over (rank r on GPU r % gpus)
  Config config;
  for (int i = 5; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-pass") pass = false;
    if (a == "--fp8") config.precision = Precision::kFp8Block;
    if (a == "--timeout-ms" && i + 1 < argc) config.peer_timeout_ms = std::atoll(argv[++i]);
    if (a == "--gpu-per-rank") {
      int count = 1;
      if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) count = 1;
      gpus = count;
      if (cudaSetDevice(rank % count) != cudaSuccess) {
        std::fprintf(stderr, "rank %d: cannot use GPU %d\n", rank, rank % count);
        return 2;
      }
    }
  }
  try {
    const HostLayer L(process_case(), seed);
    OutputBuffers global(L.c);
    global.poison();
    RankSlice slice(L, global, R, rank);
    Workspace ws(slice.shape, config);
    connect_process_group(ws, [&](const std::vector<uint8_t>& mine) {
      publish(dir, "handle" + std::to_string(rank), mine);
      std::vector<std::vector<uint8_t>> all;
      for (int32_t r = 0; r < R; ++r) {
        await_file(dir, "handle" + std::to_string(r));
        all.push_back(read_file(dir / ("handle" + std::to_string(r))));
      }
      return all;
    });
    // Ranks on one GPU pull gate/up's rows with the row-major kernel, ranks with a GPU each in the GEMM
    // (plan/layer_plan.cpp; the group tells them apart by the device UUIDs its ranks exchange), unless
    // LYNX_GEMM_GATHER chose.
    const bool chosen = ws.impl().overrides.gemm_gather >= 0;
    const bool shared = !chosen && gpus == 0, alone = !chosen && gpus >= R;
    const plan::GatherPlace place = ws.impl().plan.gate_up_gather;
    if ((shared && place != plan::GatherPlace::kRowKernel) || (alone && place != plan::GatherPlace::kInGemm)) {
      throw std::runtime_error(std::string("gate/up's rows pulled ") +
                               (place == plan::GatherPlace::kInGemm ? "in the GEMM" : "not in the GEMM") +
                               (shared ? " by ranks that share a GPU" : " by ranks with a GPU each"));
    }
    if (pass) {
      const std::vector<HostBf16> dy = process_dy(L.c, seed);
      DeviceBuffer d_dy = to_device(dy);
      const int64_t T = L.c.T / R;
      const TensorView my_dy =
          make_view(static_cast<char*>(d_dy.get()) + 2 * rank * T * L.c.H, DType::kBF16, {T, L.c.H});
      if (config.precision == Precision::kFp8Block) quantize_weights(ws, slice.in.weights, nullptr);
      forward(ws, slice.in, slice.y, nullptr);
      backward(ws, slice.in, my_dy, slice.grads, nullptr);
      ws.check(nullptr);
      publish(dir, "out" + std::to_string(rank), encode_rank_outputs(L, global, slice, R, rank));
    }
    // Every rank's memory stays mapped until every rank is done with it.
    publish(dir, "done" + std::to_string(rank), {});
    for (int32_t r = 0; r < R; ++r) {
      if (pass || r == 0) await_file(dir, "done" + std::to_string(r));
    }
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    publish(dir, "error" + std::to_string(rank), std::vector<uint8_t>(msg.begin(), msg.end()));
    publish(dir, "done" + std::to_string(rank), {});
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 3;
  }
  return 0;
}
