#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace lynx::ref {
namespace {

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }
double silu(double z) { return z * sigmoid(z); }
double silu_grad(double z) {
  const double s = sigmoid(z);
  return s * (1.0 + z * (1.0 - s));
}

template <class Src>
double dot(const Src* w, const double* v, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += to_double(w[i]) * v[i];
  return s;
}

// One SwiGLU FFN (a routed expert, or the shared one): gate/up [n, H], down [H, n].
template <class Src>
struct Ffn {
  const Src *gate, *up, *down;
  int64_t n;
};

// The expert of slot (t, j), or -1 when the slot is not routed.
template <class Src>
int64_t expert_of(const Layer<Src>& L, int64_t t, int64_t j) {
  const int64_t e = L.topk_ids[t * L.k + j];
  if (e == -1) return -1;
  if (e < 0 || e >= L.E)
    throw std::out_of_range("lynx::ref: topk_ids[" + std::to_string(t) + "," + std::to_string(j) +
                            "] = " + std::to_string(e) + " is outside [0, " + std::to_string(L.E) +
                            ")");
  return e;
}

template <class Src>
Ffn<Src> routed(const Layer<Src>& L, int64_t e) {
  return {L.w_gate + e * L.I * L.H, L.w_up + e * L.I * L.H, L.w_down + e * L.H * L.I, L.I};
}

template <class Src>
Ffn<Src> shared(const Layer<Src>& L) {
  return {L.ws_gate, L.ws_up, L.ws_down, L.I_shared};
}

// Weight gradients of one FFN; null when not wanted (the *_token entry points).
struct FfnGrads {
  double *gate = nullptr, *up = nullptr, *down = nullptr;
  double* term_square = nullptr;  // [3] += this term's squared norms (Gradients::dw_term_square)
};

double squared_norm(const double* v, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += v[i] * v[i];
  return s;
}

// Per-token buffers, allocated once per call, sized for the widest FFN.
struct Scratch {
  std::vector<double> x, g, u, a, da;
  std::vector<double> g_sq, u_sq, da_sq;  // the sums of the same terms' squares
  double d_scale_magnitude = 0.0;  // Σ |da_i a_i| of the last ffn_backward
  double d_scale_term_rss = 0.0;   // Gradients::d_topk_term_rss of the last ffn_backward
  Scratch(int64_t H, int64_t n) : x(H), g(n), u(n), a(n), da(n), g_sq(n), u_sq(n), da_sq(n) {}
  template <class Src>
  Scratch(const Layer<Src>& L) : Scratch(L.H, std::max(L.I, L.I_shared)) {}
  template <class Src>
  void load_x(const Layer<Src>& L, int64_t t) {
    for (int64_t h = 0; h < L.H; ++h) x[h] = to_double(L.x[t * L.H + h]);
  }
};

// s.g, s.u, s.a = gate·x, up·x, silu(g) ⊙ u; with kSquares (the backward's) also s.g_sq, s.u_sq, the
// sums of those terms' squares.
template <bool kSquares = false, class Src>
void hidden(const Ffn<Src>& f, int64_t H, Scratch& s) {
  for (int64_t i = 0; i < f.n; ++i) {
    double g = 0.0, u = 0.0, g_sq = 0.0, u_sq = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      const double pg = to_double(f.gate[i * H + h]) * s.x[h], pu = to_double(f.up[i * H + h]) * s.x[h];
      g += pg;
      u += pu;
      if constexpr (kSquares) {
        g_sq += pg * pg;
        u_sq += pu * pu;
      }
    }
    s.g[i] = g;
    s.u[i] = u;
    if constexpr (kSquares) {
      s.g_sq[i] = g_sq;
      s.u_sq[i] = u_sq;
    }
    s.a[i] = silu(g) * u;
  }
}

// y_row += scale · f(s.x).
template <class Src>
void ffn_forward(const Ffn<Src>& f, int64_t H, double scale, Scratch& s, double* y_row) {
  hidden(f, H, s);
  for (int64_t h = 0; h < H; ++h) y_row[h] += scale * dot(f.down + h * f.n, s.a.data(), f.n);
}

// Backward of <dy, scale · f(s.x)>: dx_row += d/dx, grads (if any) += d/dW; returns <dy, f(s.x)>,
// computed as <down^T dy, a> (the same quantity, one GEMV cheaper; the GPU does the same).
template <class Src>
double ffn_backward(const Ffn<Src>& f, int64_t H, double scale, const double* dy, Scratch& s,
                    double* dx_row, const FfnGrads& grads) {
  const int64_t n = f.n;
  hidden<true>(f, H, s);
  std::fill(s.da.begin(), s.da.begin() + n, 0.0);
  std::fill(s.da_sq.begin(), s.da_sq.begin() + n, 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const double p = dy[h] * to_double(f.down[h * n + i]);
      s.da[i] += p;
      s.da_sq[i] += p * p;
    }

  double d_scale = 0.0, term_square = 0.0;
  s.d_scale_magnitude = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    d_scale += s.da[i] * s.a[i];
    s.d_scale_magnitude += std::abs(s.da[i] * s.a[i]);
    const double dg = silu_grad(s.g[i]) * s.u[i], du = silu(s.g[i]);
    term_square += s.a[i] * s.a[i] * s.da_sq[i] + s.da[i] * s.da[i] * (dg * dg * s.g_sq[i] + du * du * s.u_sq[i]);
  }
  s.d_scale_term_rss = std::sqrt(term_square);

  // From here s.g holds dg and s.u holds du.
  for (int64_t i = 0; i < n; ++i) {
    const double g = s.g[i], u = s.u[i], dh = scale * s.da[i];
    s.g[i] = dh * u * silu_grad(g);
    s.u[i] = dh * silu(g);
  }
  for (int64_t i = 0; i < n; ++i) {
    const double dg = s.g[i], du = s.u[i];
    const Src* wg = f.gate + i * H;
    const Src* wu = f.up + i * H;
    for (int64_t h = 0; h < H; ++h) dx_row[h] += dg * to_double(wg[h]) + du * to_double(wu[h]);
  }

  if (grads.term_square) {
    const double x2 = squared_norm(s.x.data(), H);
    grads.term_square[0] += squared_norm(s.g.data(), n) * x2;
    grads.term_square[1] += squared_norm(s.u.data(), n) * x2;
    grads.term_square[2] += scale * scale * squared_norm(dy, H) * squared_norm(s.a.data(), n);
  }
  if (grads.down) {
    for (int64_t h = 0; h < H; ++h) {
      const double c = scale * dy[h];
      for (int64_t i = 0; i < n; ++i) grads.down[h * n + i] += c * s.a[i];
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        grads.gate[i * H + h] += s.g[i] * s.x[h];
        grads.up[i * H + h] += s.u[i] * s.x[h];
      }
  }
  return d_scale;
}

template <class Src>
void forward_row(const Layer<Src>& L, int64_t t, Scratch& s, double* y_row) {
  std::fill(y_row, y_row + L.H, 0.0);
  s.load_x(L, t);
  if (L.I_shared > 0) ffn_forward(shared(L), L.H, 1.0, s, y_row);
  for (int64_t j = 0; j < L.k; ++j) {
    const int64_t e = expert_of(L, t, j);
    if (e >= 0) ffn_forward(routed(L, e), L.H, L.topk_weights[t * L.k + j], s, y_row);
  }
}

// One token's backward, in the order shared, then j = 0..k-1; weight gradients only if g != null.
template <class Src>
void backward_row(const Layer<Src>& L, int64_t t, const double* dy_row, Scratch& s, double* dx_row,
                  double* d_topk_row, Gradients* g) {
  std::fill(dx_row, dx_row + L.H, 0.0);
  s.load_x(L, t);
  if (L.I_shared > 0) {
    FfnGrads sg;
    if (g) sg = {g->dws_gate.data(), g->dws_up.data(), g->dws_down.data()};
    ffn_backward(shared(L), L.H, 1.0, dy_row, s, dx_row, sg);
  }
  for (int64_t j = 0; j < L.k; ++j) {
    const int64_t e = expert_of(L, t, j);
    if (e < 0) {  // not routed
      d_topk_row[j] = 0.0;
      continue;
    }
    FfnGrads rg;
    if (g)
      rg = {g->dw_gate.data() + e * L.I * L.H, g->dw_up.data() + e * L.I * L.H,
            g->dw_down.data() + e * L.H * L.I, g->dw_term_square.data() + 3 * e};
    d_topk_row[j] =
        ffn_backward(routed(L, e), L.H, L.topk_weights[t * L.k + j], dy_row, s, dx_row, rg);
    if (g) {
      g->d_topk_magnitude[t * L.k + j] = s.d_scale_magnitude;
      g->d_topk_term_rss[t * L.k + j] = s.d_scale_term_rss;
    }
  }
}

}  // namespace

template <class Src>
std::vector<double> forward(const Layer<Src>& layer) {
  std::vector<double> y(layer.T * layer.H);
  Scratch s(layer);
  for (int64_t t = 0; t < layer.T; ++t) forward_row(layer, t, s, y.data() + t * layer.H);
  return y;
}

template <class Src>
void forward_token(const Layer<Src>& layer, int64_t t, double* y_row) {
  Scratch s(layer);
  forward_row(layer, t, s, y_row);
}

template <class Src>
Gradients backward(const Layer<Src>& layer, const double* dy) {
  const int64_t T = layer.T, H = layer.H, I = layer.I, E = layer.E, Is = layer.I_shared;
  Gradients g;
  g.dx.assign(T * H, 0.0);
  g.d_topk_weights.assign(T * layer.k, 0.0);
  g.d_topk_magnitude.assign(T * layer.k, 0.0);
  g.d_topk_term_rss.assign(T * layer.k, 0.0);
  g.dw_gate.assign(E * I * H, 0.0);
  g.dw_up.assign(E * I * H, 0.0);
  g.dw_down.assign(E * H * I, 0.0);
  g.dw_term_square.assign(3 * E, 0.0);
  g.dws_gate.assign(Is * H, 0.0);
  g.dws_up.assign(Is * H, 0.0);
  g.dws_down.assign(H * Is, 0.0);
  Scratch s(layer);
  for (int64_t t = 0; t < T; ++t)
    backward_row(layer, t, dy + t * H, s, g.dx.data() + t * H,
                 g.d_topk_weights.data() + t * layer.k, &g);
  return g;
}

template <class Src>
void backward_token(const Layer<Src>& layer, int64_t t, const double* dy_row, double* dx_row,
                    double* d_topk_row) {
  Scratch s(layer);
  backward_row(layer, t, dy_row, s, dx_row, d_topk_row, nullptr);
}

#define LYNX_REF_INSTANTIATE(Src)                                                                 \
  template std::vector<double> forward<Src>(const Layer<Src>&);                                   \
  template void forward_token<Src>(const Layer<Src>&, int64_t, double*);                          \
  template Gradients backward<Src>(const Layer<Src>&, const double*);                             \
  template void backward_token<Src>(const Layer<Src>&, int64_t, const double*, double*, double*);

LYNX_REF_INSTANTIATE(double)
LYNX_REF_INSTANTIATE(lynx::HostBf16)
#undef LYNX_REF_INSTANTIATE

}  // namespace lynx::ref
