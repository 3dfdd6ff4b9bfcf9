// lynx-bench: times the MoE layer on the benchmark shapes (bench/shapes.h) after checking it
// against the CPU reference, with the dense bf16 GEMM rate of the same GPU measured in the same run.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "common/bf16.h"
#include "common/cuda_check.h"
#include "dense_gemm.h"
#include "gpu_clock.h"
#include "lynx/lynx.h"
#include "lynx_version.h"
#include "problem.h"
#include "precision_bench.h"
#include "results_json.h"
#include "ranks_bench.h"
#include "regime.h"
#include "shapes.h"
#include "timing.h"

namespace lynx::bench {
namespace {

struct Options {
  std::vector<std::string> shapes{kDefaultShape};
  std::vector<std::string> passes{"forward", "backward", "forward+backward"};
  std::vector<Routing> routings{Routing::kUniform};
  int64_t shared_intermediate = 0;
  int warmup = 3, iters = 20, check_tokens = 8, dense_n = 8192;
  std::vector<Regime> regimes{Regime::kAsFound};
  int idle_ms = Protocol{}.idle_ms, sustain_ms = Protocol{}.sustain_ms;
  bool warmup_given = false;
  bool baseline = true;  // time the unfused path too
  bool keep_context = true;  // config.save_forward_context of both workspaces
  bool graph = false;        // time the fused path as CUDA-graph replays (the unfused path stays eager)
  std::vector<int32_t> ranks;  // --ranks: virtual-rank mode (bench/ranks_bench.h)
  bool fp8 = false;            // --precision fp8: bf16 and FP8 side by side (bench/precision_bench.h);
                               // with --ranks, every R in FP8
  int rounds = 3;
  std::string json;
  std::string command;
};

const char* kUsage =
    "usage: lynx-bench [--shape NAME|all|T,H,I,E,k] [--pass forward|backward|both|all] [--routing uniform|skewed|balanced|all]\n"
    "                  [--shared-intermediate N] [--warmup N] [--iters N] [--check-tokens N] [--dense-n N]\n"
    "                  [--baseline unfused|none] [--context keep|drop] [--launch eager|graph] [--json FILE]\n"
    "                  [--regime as-found|burst|sustained|all] [--idle-ms N] [--sustain-ms N]\n"
    "                  [--ranks R1,R2,... [--rounds N]] [--precision bf16|fp8 [--rounds N]]\n"
    "  --shape    one of qwen3-30b-a3b (default), olmoe-1b-7b, mixtral-8x7b, deepseek-v3, or all; or\n"
    "             any shape as T,H,I,E,k (tokens, hidden, intermediate, experts, top-k), e.g. 8192,8192,4096,1,1\n"
    "  --pass     both = forward+backward; all (default) = forward, backward and forward+backward\n"
    "  --routing  uniform (default): experts drawn at random; skewed: every fourth token's first pick to\n"
    "             one of 4 hot experts; balanced: every expert T*k/E rows (exactly when k | E and\n"
    "             (E/k) | T, as at every benchmark shape); all = uniform and skewed\n"
    "  --check-tokens  before timing, each path (unfused, fused) runs once into outputs poisoned with NaN and\n"
    "             is checked against the CPU reference: y, dx and d_topk_weights of N tokens spread over the\n"
    "             batch (default 8; 0: no check), and the weight gradients of the first checked token's first\n"
    "             3 experts and of the shared expert, over every row routed to them\n"
    "  --baseline time the unfused path beside the fused one (default), or not (sweeps)\n"
    "  --context  keep (default): forward saves what backward needs; drop: it does not (forward pass only;\n"
    "             the check recomputes the context before its backward; the unfused baseline stores g and u\n"
    "             either way)\n"
    "  --launch   eager (default): each timed pass is launched call by call; graph: each fused pass is\n"
    "             captured once into a CUDA graph and timed as replays (impl fused-graph; the unfused\n"
    "             baseline stays eager); the last replays' y and dx must equal an eager call's bits; with\n"
    "             --ranks, every R's forward and backward as graph replays, their bits checked again\n"
    "  --regime   the clock the passes are timed at (an H200 holds 700 W: within tens of ms of work its SM\n"
    "             clock falls from 1980 MHz to ~1200-1500). as-found (default): --warmup passes, then --iters timed\n"
    "             back to back, at whatever clock that gives; burst: before each timed pass the GPU idles\n"
    "             --idle-ms (default 500) and runs --warmup passes (default 1 here): full clock; sustained:\n"
    "             --sustain-ms (default 3000) of untimed passes first, then --iters timed back to back: inside\n"
    "             the power cap, as in training; all = burst and sustained (a row each). Every row reports\n"
    "             the median SM clock read after its timed passes and how many of them were power-capped;\n"
    "             the dense GEMM rate is measured in each regime timed\n"
    "  --ranks    expert parallelism on virtual ranks of this GPU: the same global batch (the shape's T\n"
    "             tokens, E experts) on each R given (e.g. 1,2,4,8), checked bit for bit against the first,\n"
    "             timed in --rounds (default 3) interleaved rounds, with the bytes moved between ranks and\n"
    "             the host's time to enqueue a pass; with --precision fp8, every R in FP8\n"
    "  --precision bf16 (default): the passes above; fp8 (without --ranks, nor --launch graph): the fused\n"
    "             layer in bf16 and in FP8\n"
    "             (Config::precision, docs/fp8.md) on the same problem, FP8 y and dx checked against bf16's,\n"
    "             forward and forward+backward timed in --rounds interleaved rounds, with quantize_weights\n"
    "             (once per optimizer step) beside them; --pass forward: the forwards alone, FP8 y checked\n"
    "  LYNX_BENCH_TIMES=1 in the environment prints every timed run's ms on stderr (bench/timing.h)\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "lynx-bench: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

int to_int(const std::string& flag, const std::string& v, int min) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < min) usage_error(flag + " needs an integer >= " + std::to_string(min) + ", got '" + v + "'");
  return static_cast<int>(n);
}

Options parse(int argc, char** argv) {
  Options o;
#if LYNX_EXPERIMENTS
  // Only the experiments build reads it (plan/overrides.h).
  if (const char* forced = std::getenv("LYNX_UNFUSED_GEMM")) o.command = "LYNX_UNFUSED_GEMM=" + std::string(forced) + " ";
#endif
  for (int i = 0; i < argc; ++i) {
    if (i) o.command += ' ';
    o.command += argv[i];
  }
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("missing value after " + flag);
    const std::string v = argv[++i];
    if (flag == "--shape") {
      o.shapes.clear();
      if (v == "all") {
        for (const NamedShape& s : benchmark_shapes()) o.shapes.push_back(s.name);
      } else if (parse_shape(v)) {
        o.shapes.push_back(v);
      } else {
        usage_error("unknown shape '" + v + "' (a name, or T,H,I,E,k)");
      }
    } else if (flag == "--pass") {
      if (v == "all") o.passes = {"forward", "backward", "forward+backward"};
      else if (v == "forward" || v == "backward") o.passes = {v};
      else if (v == "both" || v == "forward+backward") o.passes = {"forward+backward"};
      else usage_error("unknown pass '" + v + "'");
    } else if (flag == "--routing") {
      if (v == "uniform") o.routings = {Routing::kUniform};
      else if (v == "skewed") o.routings = {Routing::kSkewed};
      else if (v == "balanced") o.routings = {Routing::kBalanced};
      else if (v == "all") o.routings = {Routing::kUniform, Routing::kSkewed};
      else usage_error("unknown routing '" + v + "'");
    } else if (flag == "--shared-intermediate") {
      o.shared_intermediate = to_int(flag, v, 0);
    } else if (flag == "--warmup") {
      o.warmup = to_int(flag, v, 0);
      o.warmup_given = true;
    } else if (flag == "--regime") {
      const auto r = parse_regimes(v);
      if (!r) usage_error("--regime takes as-found, burst, sustained or all, got '" + v + "'");
      o.regimes = *r;
    } else if (flag == "--idle-ms") {
      o.idle_ms = to_int(flag, v, 0);
    } else if (flag == "--sustain-ms") {
      o.sustain_ms = to_int(flag, v, 0);
    } else if (flag == "--iters") {
      o.iters = to_int(flag, v, 1);
    } else if (flag == "--check-tokens") {
      o.check_tokens = to_int(flag, v, 0);
    } else if (flag == "--dense-n") {
      o.dense_n = to_int(flag, v, 256);
    } else if (flag == "--baseline") {
      if (v != "unfused" && v != "none") usage_error("--baseline takes unfused or none, got '" + v + "'");
      o.baseline = v == "unfused";
    } else if (flag == "--context") {
      if (v != "keep" && v != "drop") usage_error("--context takes keep or drop, got '" + v + "'");
      o.keep_context = v == "keep";
    } else if (flag == "--launch") {
      if (v != "eager" && v != "graph") usage_error("--launch takes eager or graph, got '" + v + "'");
      o.graph = v == "graph";
    } else if (flag == "--ranks") {
      std::stringstream list(v);
      std::string item;
      while (std::getline(list, item, ',')) o.ranks.push_back(to_int("--ranks", item, 1));
      if (o.ranks.empty()) usage_error("--ranks needs a list such as 1,2,4,8");
    } else if (flag == "--precision") {
      if (v != "bf16" && v != "fp8") usage_error("--precision takes bf16 or fp8, got '" + v + "'");
      o.fp8 = v == "fp8";
    } else if (flag == "--rounds") {
      o.rounds = to_int(flag, v, 1);
    } else if (flag == "--json") {
      o.json = v;
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  if (!o.keep_context && (o.passes.size() != 1 || o.passes[0] != "forward")) {
    usage_error("--context drop times the forward pass only: add --pass forward");
  }
  if (o.fp8 && o.ranks.empty() && o.passes.size() == 1 && o.passes[0] == "backward") {
    usage_error("--precision fp8 times the forward (--pass forward) or the forward and forward+backward, not the "
                "backward alone");
  }
  if (o.graph && o.fp8 && o.ranks.empty()) {
    usage_error("--launch graph times the passes of the default mode or of --ranks, not --precision fp8 alone");
  }
  return o;
}

// Empty when a Hopper GPU is usable, else why not.
std::string gpu_problem(std::string& name) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return std::string("no CUDA GPU available (") + (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") +
           "); lynx-bench needs a Hopper GPU (sm_90)";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot read the properties of GPU 0";
  name = prop.name;
  if (prop.major != 9) return "GPU 0 is " + name + " (sm_" + std::to_string(prop.major * 10 + prop.minor) + "); lynx-bench needs Hopper (sm_90)";
  return {};
}

struct Memory {
  std::string shape;
  double fused_ws, fused_context, unfused_ws;  // MiB
};

// The order of untimed and timed passes for one regime (bench/regime.h).
Protocol protocol(const Options& o, Regime r) {
  Protocol p;
  p.regime = r;
  p.warmup = r == Regime::kBurst && !o.warmup_given ? 1 : o.warmup;
  p.iters = o.iters;
  p.idle_ms = o.idle_ms;
  p.sustain_ms = o.sustain_ms;
  return p;
}

struct Row {
  std::string shape, routing, pass, impl;
  Regime regime;
  double ms, tflops;
  double dense_tflops;   // the dense GEMM rate in the same regime, same run
  ClockSummary clocks;   // of the fused path's timed passes
  std::string baseline_impl;  // empty: no baseline for this row
  double baseline_ms;
  std::string check;
  std::string checked;  // what the check compared (CheckReference::describe)
  double forward_part_ms, backward_part_ms;  // forward+backward only: each part within the same runs
  double enqueue_ms;                         // median host time to enqueue one timed pass
};

std::vector<uint16_t> copy_output(const TensorView& v) {
  std::vector<uint16_t> host(v.numel());
  LYNX_CUDA(cudaMemcpy(host.data(), v.data, host.size() * 2, cudaMemcpyDeviceToHost));
  return host;
}

// ‖a − b‖ / ‖b‖ over two bf16 tensors; infinite when a is not all finite.
double relative_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(HostBf16{a[i]}), y = bf16_to_float(HostBf16{b[i]});
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

std::string today() {
  char buf[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

// The --json file of this run (bench/results_json.h): nothing without --json.
ResultsJson results_json(const Options& o, const std::string& gpu) {
  return ResultsJson(o.json, today(), gpu, LYNX_GIT_COMMIT, o.command);
}

// The shape named on the command line, with --shared-intermediate, checked before a Problem's routing
// assumes it (k <= E).
NamedShape checked_shape(const Options& o, const std::string& name) {
  NamedShape shape = *parse_shape(name);
  shape.shape.shared_intermediate = o.shared_intermediate;
  validate_shape(shape.shape);
  return shape;
}

void write_json(const Options& o, const std::string& gpu, const std::vector<Row>& rows) {
  ResultsJson json = results_json(o, gpu);
  if (!json.enabled()) return;
  for (const Row& r : rows) {
    ResultsJson::Row f = json.row();
    f << "{\"shape\": " << json_string(r.shape) << ", \"routing\": " << json_string(r.routing)
      << ", \"pass\": " << json_string(r.pass) << ", \"impl\": " << json_string(r.impl)
      << ", \"regime\": " << json_string(regime_name(r.regime)) << ", \"ms\": " << r.ms
      << ", \"tflops\": " << r.tflops << ", \"baseline_impl\": "
      << (r.baseline_impl.empty() ? "null" : json_string(r.baseline_impl)) << ", \"baseline_ms\": "
      << (r.baseline_impl.empty() ? "null" : std::to_string(r.baseline_ms))
      << ", \"dense_gemm_tflops\": " << r.dense_tflops << ", \"check\": " << json_string(r.check)
      << ", \"checked\": " << json_string(r.checked)
      << ", \"enqueue_ms\": " << r.enqueue_ms;
    if (r.clocks.samples > 0) {
      f << ", \"sm_mhz\": " << r.clocks.median_mhz << ", \"memory_mhz\": " << r.clocks.median_mem_mhz
        << ", \"power_capped_fraction\": " << r.clocks.capped_fraction;
    }
    if (r.pass == "forward+backward") {
      f << ", \"forward_part_ms\": " << r.forward_part_ms << ", \"backward_part_ms\": " << r.backward_part_ms;
    }
    f << "}";
  }
  json.close();
}

// The L2 the GEMMs share, and any persisting set-aside (profiles show an "L2 Persisting Size" without
// saying whether one is set; lynx sets none). Informational: a failed query prints "unknown".
void print_l2() {
  int device = 0, l2 = 0, max_persisting = 0;
  size_t persisting = 0;
  const bool ok = cudaGetDevice(&device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&max_persisting, cudaDevAttrMaxPersistingL2CacheSize, device) == cudaSuccess &&
                  cudaDeviceGetLimit(&persisting, cudaLimitPersistingL2CacheSize) == cudaSuccess;
  if (!ok) {
    cudaGetLastError();
    std::printf("L2: unknown\n");
    return;
  }
  std::printf("L2 %.2f MB; persisting set-aside %.2f MB (at most %.2f MB)\n", l2 / 1e6, persisting / 1e6,
              max_persisting / 1e6);
}

// Calls body(name, problem, regime) for each shape and regime of a mode that prints a table per pair
// (--ranks, --precision), on the first routing.
template <class Body>
void for_each_table(const Options& o, Body&& body) {
  for (const std::string& name : o.shapes) {
    Problem p(checked_shape(o, name), o.routings.front(), 2026);
    for (Regime regime : o.regimes) body(name, p, regime);
  }
}

// --ranks: one table per shape and regime (bench/ranks_bench.h).
int run_ranks_mode(const Options& o, const std::string& gpu, const GpuClock& clock) {
  ResultsJson json = results_json(o, gpu);
  bool ok = true;
  for_each_table(o, [&](const std::string& name, Problem& p, Regime regime) {
    const Precision precision = o.fp8 ? Precision::kFp8Block : Precision::kBf16;
    const std::vector<RanksRow> rows =
        time_ranks(p, o.ranks, o.passes, protocol(o, regime), o.rounds, &clock, precision, o.graph);
    std::printf("\n%s, %s routing, %s: the same %lld tokens on R virtual ranks of this GPU, %s, %s\n",
                name.c_str(), routing_name(o.routings.front()), regime_name(regime),
                static_cast<long long>(p.shape().tokens), o.fp8 ? "FP8" : "bf16",
                o.graph ? "CUDA-graph replays" : "launched call by call");
    std::printf("%4s %-17s %9s %8s %10s %6s %11s %9s %9s  %s\n", "R", "pass", "ms", "vs first", "enqueue ms", "MHz",
                "remote rows", "fwd MB", "bwd MB", "check");
    for (const RanksRow& r : rows) {
      double base = r.ms;
      for (const RanksRow& b : rows) {
        if (b.pass == r.pass) {
          base = b.ms;
          break;
        }
      }
      ok = ok && r.check.rfind("bitwise", 0) == 0;
      std::printf("%4d %-17s %9.3f %7.3fx %10.3f %6.0f %11lld %9.1f %9.1f  %s\n", r.ranks, r.pass.c_str(), r.ms,
                  r.ms / base, r.enqueue_ms, r.clocks.samples > 0 ? r.clocks.median_mhz : 0.0, static_cast<long long>(r.traffic.remote_rows),
                  r.traffic.forward_bytes / 1e6, r.traffic.backward_bytes / 1e6, r.check.c_str());
      if (json.enabled()) {
        json.row() << "{\"shape\": " << json_string(name) << ", \"regime\": " << json_string(regime_name(regime))
                   << ", \"precision\": " << json_string(o.fp8 ? "fp8" : "bf16")
                   << ", \"launch\": " << json_string(o.graph ? "graph" : "eager") << ", \"ranks\": " << r.ranks
                   << ", \"pass\": " << json_string(r.pass) << ", \"ms\": " << r.ms
                   << ", \"enqueue_ms\": " << r.enqueue_ms
                   << ", \"sm_mhz\": " << r.clocks.median_mhz << ", \"remote_rows\": " << r.traffic.remote_rows
                   << ", \"forward_bytes\": " << r.traffic.forward_bytes
                   << ", \"backward_bytes\": " << r.traffic.backward_bytes << ", \"check\": " << json_string(r.check)
                   << "}";
      }
    }
  });
  json.close();
  return ok ? 0 : 1;
}

// A digest as 16 hex digits.
std::string hex_digest(uint64_t h) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(h));
  return s;
}

// --precision fp8: one table per shape and regime (bench/precision_bench.h).
int run_precision_mode(const Options& o, const std::string& gpu, const GpuClock& clock) {
  ResultsJson json = results_json(o, gpu);
  bool ok = true;
  for_each_table(o, [&](const std::string& name, Problem& p, Regime regime) {
    const bool forward_only = o.passes.size() == 1 && o.passes[0] == "forward";
    const PrecisionResult r = time_precisions(p, protocol(o, regime), o.rounds, &clock, forward_only);
    const bool good = r.finite && r.dissimilarity < kFp8MaxDissimilarity && r.dx_dissimilarity < kFp8MaxDxDissimilarity;
    ok = ok && good;
    if (forward_only) {
      std::printf("\n%s, %s routing, %s: FP8 against bf16, forward alone, dissimilarity of y %.2e (%s)\n",
                  name.c_str(), routing_name(o.routings.front()), regime_name(regime), r.dissimilarity,
                  good ? "ok" : r.finite ? "FAILED: above 2^-8" : "FAILED: not finite");
      std::printf("FP8 output bits (FNV-1a of y): %016llx\n", static_cast<unsigned long long>(r.fp8_bits));
    } else {
      std::printf("\n%s, %s routing, %s: FP8 against bf16, dissimilarity of y %.2e, of dx %.2e (%s)\n",
                  name.c_str(), routing_name(o.routings.front()), regime_name(regime), r.dissimilarity,
                  r.dx_dissimilarity,
                  good ? "ok" : r.finite ? "FAILED: above 2^-8 (y) or 2^-6/3 (dx)" : "FAILED: not finite");
      std::printf("FP8 output bits (FNV-1a of y, dx, d_topk_weights and the weight gradients): %016llx, with bf16 "
                  "weight gradients %016llx\n",
                  static_cast<unsigned long long>(r.fp8_bits), static_cast<unsigned long long>(r.fp8_bf16_wgrad_bits));
    }
    std::printf("%-24s %9s %9s %6s\n", "what", "ms", "vs bf16", "MHz");
    for (const PrecisionRow& row : r.rows) {
      // Each pass against the same pass in bf16; quantize_weights is no pass to compare.
      const PrecisionRow* base = nullptr;
      for (const PrecisionRow& b : r.rows) {
        if (b.what.substr(0, b.what.find(' ')) == row.what.substr(0, row.what.find(' '))) {
          base = &b;
          break;
        }
      }
      const bool pass = row.what != "quantize_weights" && base != nullptr;
      std::printf("%-24s %9.3f %9s %6.0f\n", row.what.c_str(), row.ms,
                  pass ? (std::to_string(base->ms / row.ms).substr(0, 5) + "x").c_str() : "-",
                  row.clocks.samples > 0 ? row.clocks.median_mhz : 0.0);
      if (json.enabled()) {
        json.row() << "{\"shape\": " << json_string(name) << ", \"regime\": " << json_string(regime_name(regime))
                   << ", \"what\": " << json_string(row.what) << ", \"ms\": " << row.ms
                   << ", \"sm_mhz\": " << row.clocks.median_mhz << ", \"dissimilarity\": " << r.dissimilarity
                   << ", \"dx_dissimilarity\": " << r.dx_dissimilarity
                   << ", \"forward_only\": " << (forward_only ? "true" : "false")
                   << ", \"fp8_bits\": " << json_string(hex_digest(r.fp8_bits))
                   << ", \"fp8_bf16_wgrad_bits\": " << json_string(hex_digest(r.fp8_bf16_wgrad_bits))
                   << ", \"check\": " << json_string(good ? "ok" : "FAILED") << "}";
      }
    }
  });
  json.close();
  return ok ? 0 : 1;
}

int run(const Options& o) {
  std::string gpu;
  const std::string why = gpu_problem(gpu);
  if (!why.empty()) {
    std::fprintf(stderr, "lynx-bench: %s\n", why.c_str());
    return 2;
  }
  const GpuClock clock(0);
  std::printf("lynx-bench  %s  commit %s%s\n", gpu.c_str(), LYNX_GIT_COMMIT,
              clock.available() ? "" : "  (SM clock unknown: NVML not found)");
  std::vector<double> dense(o.regimes.size());
  for (size_t i = 0; i < o.regimes.size(); ++i) {
    Protocol p = protocol(o, o.regimes[i]);
    if (o.regimes[i] == Regime::kAsFound) p.warmup += 2;
    const DenseRate d = dense_gemm_rate(o.dense_n, p, &clock);
    dense[i] = d.tflops;
    std::printf("dense bf16 GEMM %d^3, %s: %.1f TFLOP/s", o.dense_n, regime_name(o.regimes[i]), d.tflops);
    if (d.clocks.samples > 0) {
      std::printf(" at %.0f MHz (memory %.0f MHz), power-capped in %.0f%% of the passes", d.clocks.median_mhz,
                  d.clocks.median_mem_mhz, 100.0 * d.clocks.capped_fraction);
    }
    std::printf("\n");
  }
  print_l2();
  if (!o.ranks.empty()) return run_ranks_mode(o, gpu, clock);
  if (o.fp8) return run_precision_mode(o, gpu, clock);
  std::vector<Row> rows;
  std::vector<Memory> memory;
  bool all_ok = true;
  for (const std::string& name : o.shapes) {
    const NamedShape shape = checked_shape(o, name);
    for (Routing routing : o.routings) {
      Problem p(shape, routing, 2026);
      Config fused_config, unfused_config;
      fused_config.backend = Backend::kFused;
      unfused_config.backend = Backend::kUnfused;
      fused_config.save_forward_context = unfused_config.save_forward_context = o.keep_context;
      Workspace fused(p.shape(), fused_config), unfused(p.shape(), unfused_config);
      const LayerInputs in = p.inputs();
      const Gradients grads = p.gradients();
      // Correctness first: each path's outputs against the CPU reference, and the fused forward's whole
      // output against the unfused one.
      std::string check_text = "not checked", checked_text;
      bool ok = true;
      if (o.check_tokens > 0) {
        const CheckReference want = check_reference(p, o.check_tokens, true);
        checked_text = want.describe();
        std::vector<std::string> parts;
        std::vector<uint16_t> y_unfused;
        for (Workspace* ws : {&unfused, &fused}) {
          poison_outputs(p);
          forward(*ws, in, p.y(), nullptr);
          if (!o.keep_context) recompute_forward_context(*ws, in, nullptr);
          backward(*ws, in, p.dy(), grads, nullptr);
          ws->check(nullptr);
          const CheckResult c = check_outputs(p, want);
          ok = ok && c.ok;
          parts.push_back((ws == &fused ? "fused " : "unfused ") + c.summary());
          if (ws == &unfused) y_unfused = copy_output(p.y());
        }
        const double vs = relative_difference(copy_output(p.y()), y_unfused);
        ok = ok && vs < kCheckTolerance;
        char buf[64];
        std::snprintf(buf, sizeof buf, "; fused y vs unfused %.1e", vs);
        check_text = parts[0] + "; " + parts[1] + buf;
      }
      if (!ok) {
        std::fprintf(stderr, "lynx-bench: %s (%s routing) FAILED the correctness check: %s (tolerance %.0e; checked: %s); not timed\n",
                     name.c_str(), routing_name(routing), check_text.c_str(), kCheckTolerance, checked_text.c_str());
        all_ok = false;
        continue;
      }
      forward(fused, in, p.y(), nullptr);
      LYNX_CUDA(cudaDeviceSynchronize());
      if (routing == o.routings.front()) {
        constexpr double kMiB = 1024.0 * 1024.0;
        memory.push_back({name, fused.device_bytes() / kMiB, fused.context_bytes() / kMiB, unfused.device_bytes() / kMiB});
      }
      const double fwd_flops = forward_flops(p.shape());
      // One pass timed on stream `s` from what runs a forward and a backward.
      auto time_runs = [&](const auto& run_forward, const auto& run_backward, const std::string& pass,
                           const Protocol& pr, cudaStream_t s) -> SplitMs {
        if (pass == "forward") {
          const Timing t = time_pass(run_forward, pr, s, &clock);
          return {t.ms, t.ms, 0.0, t.enqueue_ms, t.clocks};
        }
        if (pass == "backward") {
          run_forward();
          const Timing t = time_pass(run_backward, pr, s, &clock);
          return {t.ms, 0.0, t.ms, t.enqueue_ms, t.clocks};
        }
        return time_split(run_forward, run_backward, pr, s, &clock);
      };
      // Graph mode: the fused passes captured on their own stream and replayed there (backward only
      // for the passes that time it: with --context drop it has no context to run on). The last
      // replays' y (and dx) must be the bits of an eager call of the same pass, which the check above
      // compared with the reference: a graph that replayed stale work would fail here.
      std::string graph_mismatch;
      auto time_graph = [&](Workspace& ws, const std::string& pass, const Protocol& pr) -> SplitMs {
        const OwnedStream stream;
        const cudaStream_t s = stream.get();
        const bool backward_too = pass != "forward";
        forward(ws, in, p.y(), s);
        if (backward_too) backward(ws, in, p.dy(), grads, s);
        LYNX_CUDA(cudaStreamSynchronize(s));
        ws.check(s);
        const std::vector<uint16_t> y_eager = copy_output(p.y());
        const std::vector<uint16_t> dx_eager = backward_too ? copy_output(grads.dx) : std::vector<uint16_t>{};
        poison_outputs(p);
        const CapturedGraph fwd(s, [&] { forward(ws, in, p.y(), s); });
        std::optional<CapturedGraph> bwd;
        if (backward_too) bwd.emplace(s, [&] { backward(ws, in, p.dy(), grads, s); });
        const SplitMs t = time_runs([&] { fwd.launch(s); }, [&] { bwd->launch(s); }, pass, pr, s);
        LYNX_CUDA(cudaStreamSynchronize(s));
        ws.check(s);
        if (copy_output(p.y()) != y_eager || (backward_too && copy_output(grads.dx) != dx_eager)) {
          graph_mismatch = pass + ": the graph replays' " + (copy_output(p.y()) != y_eager ? "y" : "dx") +
                           " differ from an eager call's";
        }
        return t;
      };
      auto time_layer = [&](Workspace& ws, const std::string& pass, const Protocol& pr) -> SplitMs {
        if (o.graph && &ws == &fused) return time_graph(ws, pass, pr);
        return time_runs([&] { forward(ws, in, p.y(), nullptr); },
                         [&] { backward(ws, in, p.dy(), grads, nullptr); }, pass, pr, nullptr);
      };
      for (const std::string& pass : o.passes) {
        const double flops = (pass == "forward" ? 1 : pass == "backward" ? 2 : 3) * fwd_flops;
        for (size_t ri = 0; ri < o.regimes.size(); ++ri) {
          const Protocol pr = protocol(o, o.regimes[ri]);
          const double base = o.baseline ? time_layer(unfused, pass, pr).total : 0.0;
          const SplitMs t = time_layer(fused, pass, pr);
          if (!graph_mismatch.empty()) {
            std::fprintf(stderr, "lynx-bench: %s (%s routing) FAILED: %s\n", name.c_str(), routing_name(routing),
                         graph_mismatch.c_str());
            all_ok = false;
            graph_mismatch.clear();
          }
          const char* impl = o.graph ? "fused-graph" : "fused";
          rows.push_back({name, routing_name(routing), pass, impl, o.regimes[ri], t.total,
                          flops / (t.total * 1e-3) / 1e12, dense[ri], t.clocks, o.baseline ? "unfused" : "", base,
                          check_text, checked_text, t.first, t.second, t.enqueue});
        }
      }
    }
  }
  std::printf("\n%-15s %-8s %-17s %-11s %-9s %8s %8s %7s %5s %6s %7s %10s %8s\n", "shape", "routing", "pass", "impl",
              "regime", "ms", "TFLOP/s", "%dense", "MHz", "memMHz", "capped", "unfused ms", "speedup");
  for (const Row& r : rows) {
    std::printf("%-15s %-8s %-17s %-11s %-9s %8.3f %8.1f %6.1f%%", r.shape.c_str(), r.routing.c_str(), r.pass.c_str(),
                r.impl.c_str(), regime_name(r.regime), r.ms, r.tflops, 100.0 * r.tflops / r.dense_tflops);
    if (r.clocks.samples > 0) {
      std::printf(" %5.0f %6.0f %6.0f%%", r.clocks.median_mhz, r.clocks.median_mem_mhz, 100.0 * r.clocks.capped_fraction);
    } else {
      std::printf(" %5s %6s %7s", "-", "-", "-");
    }
    if (r.baseline_impl.empty()) {
      std::printf(" %10s %8s\n", "-", "-");
    } else {
      std::printf(" %10.3f %7.2fx\n", r.baseline_ms, r.baseline_ms / r.ms);
    }
  }
  bool parts_header = false;
  for (const Row& r : rows) {
    if (r.pass != "forward+backward") continue;
    if (!parts_header) {
      std::printf("\nfused forward+backward in parts (median ms of each part, within the same runs):\n");
      parts_header = true;
    }
    std::printf("  %-15s %-8s %-9s forward %8.3f  backward %8.3f\n", r.shape.c_str(), r.routing.c_str(),
                regime_name(r.regime), r.forward_part_ms, r.backward_part_ms);
  }
  std::printf("\nhost time to enqueue one timed fused pass (median ms; the GPU time above includes what it waits\n"
              "for when the passes are launched call by call):\n");
  for (const Row& r : rows) {
    std::printf("  %-15s %-8s %-17s %-9s %8.3f\n", r.shape.c_str(), r.routing.c_str(), r.pass.c_str(),
                regime_name(r.regime), r.enqueue_ms);
  }
  std::printf("\ndevice memory (MiB): workspace fused / unfused, and the saved forward context (in the fused workspace)\n");
  for (const Memory& m : memory) {
    std::printf("  %-15s workspace %8.0f / %8.0f   context %8.0f\n", m.shape.c_str(), m.fused_ws, m.unfused_ws,
                m.fused_context);
  }
  std::printf("\nchecks (relative error vs the CPU reference, tolerance %.0e; each path into outputs poisoned with NaN;\n"
              "dW: the worst of the checked weight gradients):\n", kCheckTolerance);
  std::string last;
  for (const Row& r : rows) {
    if (r.shape + r.routing == last) continue;
    last = r.shape + r.routing;
    std::printf("  %s %s: %s\n", r.shape.c_str(), r.routing.c_str(), r.check.c_str());
    if (!r.checked.empty()) std::printf("    checked: %s\n", r.checked.c_str());
  }
  write_json(o, gpu, rows);
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace lynx::bench

int main(int argc, char** argv) {
  const lynx::bench::Options options = lynx::bench::parse(argc, argv);
  try {
    return lynx::bench::run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lynx-bench: %s\n", e.what());
    return 1;
  }
}
