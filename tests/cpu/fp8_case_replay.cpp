// lynx-fp8-case-replay: replays the d_topk_weights of an FP8 random case dumped by the GPU tests
// (LYNX_RANDOM_DUMP=DIR writes DIR/<seed>/, tests/gpu/case_dump.h) against the FP8 backward's CPU
// emulation (reference/fp8_layer.h) and the exact layer (reference/reference.h), without a GPU.
//   usage: lynx-fp8-case-replay DIR/<seed> [--values]
// Prints the case's line, then one line: the GPU's error, the emulation's and GPU-vs-emulation, each
// relative to the exact values' norm and to the root-sum-square of d_topk_term_rss, and the largest
// difference between the dumped fp64 reference and the one recomputed here. --values first prints
// every slot's values.
// Exit status: 0 when the GPU and the emulation agree within 1e-2 of the exact values' norm; 1 when
// they do not (or the GPU's values are not finite); 2 when the case cannot be replayed: a missing or
// wrongly sized file, a tensor whose dtype or shape is not the one expected, an expert id outside
// [-1, E), a non-finite input, a case that is not FP8.
// Neither the shared expert (Is > 0, bf16 even in FP8) nor the rank count R changes d_topk_weights: a
// slot's value is one rank's dot product over I, which the routed layer at one rank replays.
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "reference/fp8_layer.h"
#include "reference/reference.h"

namespace {

constexpr double kAgreement = 1e-2;  // of the exact values' norm

struct TensorInfo {
  std::string dtype;
  std::vector<int64_t> shape;
};

struct Manifest {
  std::string seed;
  std::string description;  // tests/gpu/random_case.h's describe()
  std::map<std::string, TensorInfo> tensors;
};

// Reads the JSON that case_dump.cpp writes: objects, arrays, strings (escapes \" and \\ only) and
// numbers; anything else is refused.
class ManifestParser {
 public:
  explicit ManifestParser(std::string text) : text_(std::move(text)) {}

  Manifest parse() {
    Manifest m;
    object([&](const std::string& key) {
      if (key == "seed") {
        m.seed = number();
      } else if (key == "case") {
        m.description = string();
      } else if (key == "tensors") {
        object([&](const std::string& name) { m.tensors[name] = tensor(); });
      } else {
        skip_value();
      }
    });
    skip_space();
    if (pos_ != text_.size()) fail("text after the manifest's object");
    return m;
  }

 private:
  std::string text_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("manifest.json: " + what + " (byte " + std::to_string(pos_) + ")");
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char peek() {
    skip_space();
    return pos_ < text_.size() ? text_[pos_] : '\0';
  }
  bool consume(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!consume(c)) fail(std::string("expected '") + c + "'");
  }

  std::string string() {
    expect('"');
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\') {
        ++pos_;
        if (pos_ >= text_.size() || (text_[pos_] != '"' && text_[pos_] != '\\')) fail("unsupported escape");
      }
      out += text_[pos_++];
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }
  std::string number() {
    skip_space();
    const size_t start = pos_;
    while (pos_ < text_.size() && std::string_view("+-.eE0123456789").find(text_[pos_]) != std::string_view::npos) {
      ++pos_;
    }
    if (pos_ == start) fail("expected a value");
    return text_.substr(start, pos_ - start);
  }
  int64_t dimension() {
    const std::string digits = number();
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 12) {
      fail("a shape's dimension is not a non-negative integer: " + digits);
    }
    return std::stoll(digits);
  }

  // member(key) reads each member's value.
  template <class Member>
  void object(Member&& member) {
    expect('{');
    if (consume('}')) return;
    do {
      const std::string key = string();
      expect(':');
      member(key);
    } while (consume(','));
    expect('}');
  }
  template <class Element>
  void array(Element&& element) {
    expect('[');
    if (consume(']')) return;
    do element();
    while (consume(','));
    expect(']');
  }
  void skip_value() {
    switch (peek()) {
      case '{': object([&](const std::string&) { skip_value(); }); break;
      case '[': array([&] { skip_value(); }); break;
      case '"': string(); break;
      default: number();
    }
  }
  TensorInfo tensor() {
    TensorInfo info;
    object([&](const std::string& key) {
      if (key == "dtype") {
        info.dtype = string();
      } else if (key == "shape") {
        array([&] { info.shape.push_back(dimension()); });
      } else {
        skip_value();
      }
    });
    return info;
  }
};

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out;
  for (const int64_t d : shape) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return "[" + out + "]";
}

class CaseDir {
 public:
  explicit CaseDir(std::string dir) : dir_(std::move(dir)) {
    std::ifstream in(dir_ + "/manifest.json");
    if (!in) throw std::runtime_error("cannot read " + dir_ + "/manifest.json");
    std::stringstream text;
    text << in.rdbuf();
    manifest = ManifestParser(text.str()).parse();
  }

  Manifest manifest;

  const TensorInfo& info(const std::string& name) const {
    const auto it = manifest.tensors.find(name);
    if (it == manifest.tensors.end()) throw std::runtime_error("manifest.json names no tensor " + name);
    return it->second;
  }

  // Tensor `name`, checked against its dtype and shape in the manifest and its file's size.
  template <class T>
  std::vector<T> load(const std::string& name, const char* dtype, const std::vector<int64_t>& shape) const {
    const TensorInfo& entry = info(name);
    if (entry.dtype != dtype) throw std::runtime_error(name + " is " + entry.dtype + ", expected " + dtype);
    if (entry.shape != shape) {
      throw std::runtime_error(name + " has shape " + shape_text(entry.shape) + ", expected " + shape_text(shape));
    }
    size_t count = 1;
    for (const int64_t d : shape) {
      if (d > 0 && count > SIZE_MAX / sizeof(T) / size_t(d)) throw std::runtime_error(name + "'s shape is too large");
      count *= size_t(d);
    }
    const std::string path = dir_ + "/" + name + ".bin";
    std::error_code error;
    const uintmax_t bytes = std::filesystem::file_size(path, error);
    if (error) throw std::runtime_error("cannot read " + path + ": " + error.message());
    if (bytes != count * sizeof(T)) {
      throw std::runtime_error(path + " holds " + std::to_string(bytes) + " bytes, its shape " + shape_text(shape) +
                               " needs " + std::to_string(count * sizeof(T)));
    }
    std::vector<T> values(count);
    std::ifstream in(path, std::ios::binary);
    if (!in.read(reinterpret_cast<char*>(values.data()), std::streamsize(bytes))) {
      throw std::runtime_error("cannot read " + path);
    }
    return values;
  }

 private:
  std::string dir_;
};

std::vector<int64_t> shape_of(const CaseDir& dir, const std::string& name, size_t rank) {
  const std::vector<int64_t>& shape = dir.info(name).shape;
  if (shape.size() != rank) {
    throw std::runtime_error(name + " has shape " + shape_text(shape) + ", not of rank " + std::to_string(rank));
  }
  return shape;
}

std::vector<float> widened(const std::vector<lynx::HostBf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = lynx::bf16_to_float(v[i]);
  return out;
}

// √(error² / norm²), or 0 / ∞ where the norm is 0.
double relative(double error2, double norm2) {
  if (norm2 > 0.0) return std::sqrt(error2 / norm2);
  return error2 == 0.0 ? 0.0 : INFINITY;
}

int replay(const std::string& path, bool values) {
  const CaseDir dir(path);
  const std::string& description = dir.manifest.description;
  if (description.find("precision=fp8") == std::string::npos) {
    throw std::runtime_error("not an FP8 case (its description lacks precision=fp8): '" + description + "'");
  }
  const std::vector<int64_t> x_shape = shape_of(dir, "x", 2), w_shape = shape_of(dir, "w_gate", 3),
                             ids_shape = shape_of(dir, "topk_ids", 2);
  const int64_t T = x_shape[0], H = x_shape[1], E = w_shape[0], I = w_shape[1], k = ids_shape[1];
  using lynx::HostBf16;
  const std::vector<HostBf16> x = dir.load<HostBf16>("x", "bf16", {T, H});
  const std::vector<HostBf16> dy = dir.load<HostBf16>("dy", "bf16", {T, H});
  const std::vector<HostBf16> w_gate = dir.load<HostBf16>("w_gate", "bf16", {E, I, H});
  const std::vector<HostBf16> w_up = dir.load<HostBf16>("w_up", "bf16", {E, I, H});
  const std::vector<HostBf16> w_down = dir.load<HostBf16>("w_down", "bf16", {E, H, I});
  const std::vector<float> topk_weights = dir.load<float>("topk_weights", "float32", {T, k});
  const std::vector<float> gpu = dir.load<float>("d_topk_weights", "float32", {T, k});
  const std::vector<double> dumped_exact = dir.load<double>("ref_d_topk_weights", "float64", {T, k});
  // case_dump.cpp writes int32 ids whatever the case gave the GPU (its description's ids=); int64 is read too.
  std::vector<int64_t> wide_ids;
  if (dir.info("topk_ids").dtype == "int64") {
    wide_ids = dir.load<int64_t>("topk_ids", "int64", {T, k});
  } else {
    const std::vector<int32_t> narrow = dir.load<int32_t>("topk_ids", "int32", {T, k});
    wide_ids.assign(narrow.begin(), narrow.end());
  }
  // The dump holds NaN router weights in slots not routed; neither reference reads them.
  std::vector<int32_t> ids(wide_ids.size());
  std::vector<double> weights(wide_ids.size(), 0.0);
  for (size_t s = 0; s < ids.size(); ++s) {
    if (wide_ids[s] < -1 || wide_ids[s] >= E) {
      throw std::runtime_error("topk_ids[" + std::to_string(s) + "] = " + std::to_string(wide_ids[s]) +
                               " is outside [-1, " + std::to_string(E) + ")");
    }
    ids[s] = int32_t(wide_ids[s]);
    if (ids[s] >= 0) weights[s] = topk_weights[s];
  }

  const std::vector<float> x_f = widened(x), dy_f = widened(dy), w_gate_f = widened(w_gate), w_up_f = widened(w_up),
                           w_down_f = widened(w_down);
  lynx::ref::fp8::RoutedLayer routed;
  routed.T = T, routed.H = H, routed.I = I, routed.E = E, routed.k = k;
  routed.x = x_f.data();
  routed.topk_ids = ids.data();
  routed.topk_weights = weights.data();
  routed.w_gate = w_gate_f.data();
  routed.w_up = w_up_f.data();
  routed.w_down = w_down_f.data();
  const std::vector<double> emulated = lynx::ref::fp8::routed_backward(routed, dy_f.data()).d_topk_weights;

  lynx::ref::Layer<HostBf16> layer;
  layer.T = T, layer.H = H, layer.I = I, layer.E = E, layer.k = k;
  layer.x = x.data();
  layer.topk_ids = ids.data();
  layer.topk_weights = weights.data();
  layer.w_gate = w_gate.data();
  layer.w_up = w_up.data();
  layer.w_down = w_down.data();
  const std::vector<double> dy_d(dy_f.begin(), dy_f.end());
  const lynx::ref::Gradients exact = lynx::ref::backward(layer, dy_d.data());

  std::printf("seed %s: %s\n", dir.manifest.seed.c_str(), description.c_str());
  double exact2 = 0, rss2 = 0, gpu2 = 0, emulated2 = 0, apart2 = 0, dumped_apart = 0;
  for (size_t s = 0; s < ids.size(); ++s) {
    const double want = exact.d_topk_weights[s], rss = exact.d_topk_term_rss[s];
    exact2 += want * want;
    rss2 += rss * rss;
    gpu2 += (gpu[s] - want) * (gpu[s] - want);
    emulated2 += (emulated[s] - want) * (emulated[s] - want);
    apart2 += (gpu[s] - emulated[s]) * (gpu[s] - emulated[s]);
    dumped_apart = std::fmax(dumped_apart, std::fabs(dumped_exact[s] - want));
    if (values) {
      std::printf("  t %lld j %lld id %d: exact %+.6e gpu %+.6e emulation %+.6e term_rss %.6e\n",
                  static_cast<long long>(s / k), static_cast<long long>(s % k), ids[s], want, double(gpu[s]),
                  emulated[s], rss);
    }
  }
  const double apart = relative(apart2, exact2);
  const bool agree = apart <= kAgreement;  // false for NaN too
  std::printf(
      "d_topk_weights (%zu slots): |exact| %.4e |term_rss| %.4e; relative to |exact|: gpu %.3e emulation %.3e "
      "gpu-vs-emulation %.3e; relative to |term_rss|: gpu %.3e emulation %.3e gpu-vs-emulation %.3e; dumped "
      "reference vs this one: max %.2e; gpu and emulation %s %g of |exact|\n",
      ids.size(), std::sqrt(exact2), std::sqrt(rss2), relative(gpu2, exact2), relative(emulated2, exact2), apart,
      relative(gpu2, rss2), relative(emulated2, rss2), relative(apart2, rss2), dumped_apart,
      agree ? "agree within" : "differ by more than", kAgreement);
  return agree ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> paths;
  bool values = false;
  bool unknown_flag = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--values") {
      values = true;
    } else if (arg.empty() || arg[0] == '-') {
      unknown_flag = true;
    } else {
      paths.push_back(arg);
    }
  }
  if (paths.size() != 1 || unknown_flag) {
    std::fprintf(stderr, "usage: lynx-fp8-case-replay DIR/<seed> [--values]\n");
    return 2;
  }
  try {
    return replay(paths[0], values);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lynx-fp8-case-replay: %s: %s\n", paths[0].c_str(), e.what());
    return 2;
  }
}
