#include "gpu/case_dump.h"

#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>

namespace lynx::test {
namespace {

struct Writer {
  std::string dir;
  std::string manifest;

  void write(const std::string& name, const char* dtype, const std::vector<int64_t>& shape, const void* data,
             size_t bytes) {
    FILE* f = std::fopen((dir + "/" + name + ".bin").c_str(), "wb");
    if (f == nullptr) throw std::runtime_error("cannot write " + dir + "/" + name + ".bin");
    const size_t wrote = bytes > 0 ? std::fwrite(data, 1, bytes, f) : 0;
    const bool closed = std::fclose(f) == 0;
    if (wrote != bytes || !closed) throw std::runtime_error("cannot write " + dir + "/" + name + ".bin");
    std::string dims;
    for (const int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    manifest += std::string(manifest.empty() ? "" : ",\n") + "    \"" + name + "\": {\"dtype\": \"" + dtype +
                "\", \"shape\": [" + dims + "]}";
  }
  template <class T>
  void write(const std::string& name, const char* dtype, const std::vector<int64_t>& shape, const std::vector<T>& v) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    if (int64_t(v.size()) != n) throw std::runtime_error(name + ": " + std::to_string(v.size()) + " values for its shape");
    write(name, dtype, shape, v.data(), v.size() * sizeof(T));
  }
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) out += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
  return out + "\"";
}

}  // namespace

void dump_case(const std::string& dir, uint64_t seed, const std::string& what, const HostLayer& L,
               const std::vector<HostBf16>& dy, const Outputs& got, const Reference& want) {
  const Case& c = L.c;
  Writer w{dir + "/" + std::to_string(seed), ""};
  ::mkdir(dir.c_str(), 0755);
  ::mkdir(w.dir.c_str(), 0755);
  const int64_t T = c.T, H = c.H, I = c.I, E = c.E, k = c.k, Is = c.Is;
  w.write("x", "bf16", {T, H}, L.x);
  w.write("dy", "bf16", {T, H}, dy);
  w.write("w_gate", "bf16", {E, I, H}, L.w_gate);
  w.write("w_up", "bf16", {E, I, H}, L.w_up);
  w.write("w_down", "bf16", {E, H, I}, L.w_down);
  w.write("ws_gate", "bf16", {Is, H}, L.ws_gate);
  w.write("ws_up", "bf16", {Is, H}, L.ws_up);
  w.write("ws_down", "bf16", {H, Is}, L.ws_down);
  w.write("topk_ids", "int32", {T, k}, L.ids);
  w.write("topk_weights", "float32", {T, k}, L.weights);
  // Each output beside its reference ("ref_" + name).
  const ref::Gradients& g = want.g;
  struct Output {
    const char* name;
    std::vector<int64_t> shape;
    const std::vector<HostBf16>& got;
    const std::vector<double>& want;
  };
  const Output outputs[] = {{"y", {T, H}, got.y, want.y},
                            {"dx", {T, H}, got.dx, g.dx},
                            {"dw_gate", {E, I, H}, got.dw_gate, g.dw_gate},
                            {"dw_up", {E, I, H}, got.dw_up, g.dw_up},
                            {"dw_down", {E, H, I}, got.dw_down, g.dw_down},
                            {"dws_gate", {Is, H}, got.dws_gate, g.dws_gate},
                            {"dws_up", {Is, H}, got.dws_up, g.dws_up},
                            {"dws_down", {H, Is}, got.dws_down, g.dws_down}};
  for (const Output& out : outputs) {
    w.write(out.name, "bf16", out.shape, out.got);
    w.write(std::string("ref_") + out.name, "float64", out.shape, out.want);
  }
  w.write("d_topk_weights", "float32", {T, k}, got.d_topk);
  w.write("ref_d_topk_weights", "float64", {T, k}, g.d_topk_weights);
  const std::string path = w.dir + "/manifest.json";
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  std::fprintf(f, "{\n  \"seed\": %llu,\n  \"case\": %s,\n  \"tensors\": {\n%s\n  }\n}\n",
               static_cast<unsigned long long>(seed), json_string(what).c_str(), w.manifest.c_str());
  if (std::fclose(f) != 0) throw std::runtime_error("cannot write " + path);
}

}  // namespace lynx::test
