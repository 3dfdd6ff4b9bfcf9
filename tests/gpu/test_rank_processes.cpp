// Expert parallelism across processes (Processes.*): R processes (lynx_rank_process) on this GPU, or
// one per GPU where there are several, connected through CUDA IPC, give the bits of one rank, in bf16
// and in FP8; a rank that never runs its pass is reported.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gpu/rank_process_io.h"

extern char** environ;

namespace fs = std::filesystem;

namespace lynx::test {
namespace {

class Processes : public GpuTest {};

fs::path helper() { return fs::read_symlink("/proc/self/exe").parent_path() / "lynx_rank_process"; }

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("lynx-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Starts one process per rank and waits for all; returns their exit codes.
std::vector<int> run_processes(const fs::path& dir, int32_t R, uint64_t seed, const std::vector<std::vector<std::string>>& extra) {
  std::vector<pid_t> pids;
  for (int32_t r = 0; r < R; ++r) {
    std::vector<std::string> args{helper().string(), dir.string(), std::to_string(r), std::to_string(R),
                                  std::to_string(seed)};
    for (const auto& a : extra[r]) args.push_back(a);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    EXPECT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0) << "cannot start " << argv[0];
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

// R processes give one rank's bits; in FP8 (`fp8`) one rank's FP8 bits (Fp8Layer.* check those); each
// on a GPU of its own with `gpu_per_rank`.
void check_processes(int32_t R, bool fp8 = false, bool gpu_per_rank = false) {
  const Case c = process_case();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("R = " + std::to_string(R) + " seed " + std::to_string(seed) + (fp8 ? " fp8" : ""));
  const HostLayer L(c, seed);
  Config config;
  if (fp8) config.precision = Precision::kFp8Block;
  Workspace one(L.shape, config);
  if (fp8) quantize_weights(one, L.inputs().weights, nullptr);
  const Outputs want = run_layer(one, L, process_dy(c, seed));
  one.check(nullptr);
  const fs::path dir = fresh_dir("ranks" + std::to_string(R));
  std::vector<std::string> flags;
  if (fp8) flags.push_back("--fp8");
  if (gpu_per_rank) {  // a short timeout: a rank that fails leaves the others waiting seconds, not 30
    for (const char* f : {"--gpu-per-rank", "--timeout-ms", "10000"}) flags.push_back(f);
  }
  const std::vector<std::vector<std::string>> args(R, flags);
  const std::vector<int> codes = run_processes(dir, R, seed, args);
  Outputs got = want;
  SharedSums shared;
  for (int32_t r = 0; r < R; ++r) {
    ASSERT_EQ(codes[r], 0) << "rank " << r << ": " << read_text(dir / ("error" + std::to_string(r)));
    const std::string bytes = read_text(dir / ("out" + std::to_string(r)));
    decode_rank_outputs(c, R, r, std::vector<uint8_t>(bytes.begin(), bytes.end()), got, &shared);
  }
  EXPECT_EQ(first_routed_difference(got, want), "") << "R processes differ from one rank";
  expect_shared_sums_near(shared, want);
  fs::remove_all(dir);
}

TEST_F(Processes, TwoOnOneGpu) { check_processes(2); }

TEST_F(Processes, FourOnOneGpu) { check_processes(4); }

TEST_F(Processes, TwoOnOneGpuFp8) { check_processes(2, true); }

// A process per GPU (the process-group transport across GPUs, CUDA IPC); skipped without two or more
// GPUs with peer access to each other.
TEST_F(Processes, OnePerGpu) {
  if (peer_group_gpus() == 0) GTEST_SKIP() << "needs two or more GPUs with peer access to each other";
  check_processes(peer_group_gpus(), false, true);
}

TEST_F(Processes, OnePerGpuFp8) {
  if (peer_group_gpus() == 0) GTEST_SKIP() << "needs two or more GPUs with peer access to each other";
  check_processes(peer_group_gpus(), true, true);
}

// Rank 1 connects but never runs its pass: rank 0 reports it and stops (on one GPU, and on two GPUs
// where there are two).
void expect_missing_rank_reported(bool gpu_per_rank) {
  const fs::path dir = fresh_dir(gpu_per_rank ? "missing-gpus" : "missing");
  std::vector<std::vector<std::string>> args{{"--timeout-ms", "1000"}, {"--timeout-ms", "1000", "--no-pass"}};
  if (gpu_per_rank) {
    for (auto& a : args) a.push_back("--gpu-per-rank");
  }
  const std::vector<int> codes = run_processes(dir, 2, 5, args);
  EXPECT_EQ(codes[0], 3);
  EXPECT_EQ(codes[1], 0);
  const std::string msg = read_text(dir / "error0");
  EXPECT_NE(msg.find("rank 1 had not arrived"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST_F(Processes, RankThatNeverArrivesIsReported) { expect_missing_rank_reported(false); }

TEST_F(Processes, RankThatNeverArrivesIsReportedAcrossGpus) {
  if (peer_group_gpus() == 0) GTEST_SKIP() << "needs two or more GPUs with peer access to each other";
  expect_missing_rank_reported(true);
}

}  // namespace
}  // namespace lynx::test
