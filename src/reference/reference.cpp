#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/parallel.h"

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

// Weight gradients of one FFN (weight_gradients below).
struct FfnGrads {
  double *gate = nullptr, *up = nullptr, *down = nullptr;
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

// Backward of <dy, scale · f(s.x)>: dx_row += d/dx; where dw_factors is given, [5] the factors of this
// term's squared norms in dw_gate, dw_up and dw_down (Gradients::dw_term_square: [0]·[2], [1]·[2],
// [3]·[4], summed in token order by backward()); returns <dy, f(s.x)>, computed as <down^T dy, a> (the
// same quantity, one GEMV cheaper; the GPU does the same). s.g and s.u then hold dg and du.
// NOTES: factors, not products: backward() adds each product to its sum in one expression, as a pass
// over the tokens did, so that a compiler that fuses a multiply and an add fuses the same ones.
template <class Src>
double ffn_backward(const Ffn<Src>& f, int64_t H, double scale, const double* dy, Scratch& s,
                    double* dx_row, double* dw_factors) {
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

  if (dw_factors) {
    dw_factors[0] = squared_norm(s.g.data(), n);
    dw_factors[1] = squared_norm(s.u.data(), n);
    dw_factors[2] = squared_norm(s.x.data(), H);
    dw_factors[3] = scale * scale * squared_norm(dy, H);
    dw_factors[4] = squared_norm(s.a.data(), n);
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

// What backward() keeps of each slot besides d_topk_weights (null in backward_token): [k] its
// magnitude and term RSS; [k][kDwFactors] the factors of its terms of Gradients::dw_term_square; [k][I]
// its a, dg and du; and [I_shared] the shared expert's a, dg and du.
constexpr int64_t kDwFactors = 5;
struct SlotOutputs {
  double *magnitude = nullptr, *term_rss = nullptr, *dw_factors = nullptr;
  double *a = nullptr, *dg = nullptr, *du = nullptr;
  double *shared_a = nullptr, *shared_dg = nullptr, *shared_du = nullptr;
};

// s.a, s.g (dg) and s.u (du) of the last ffn_backward, n each, to a, dg and du (if a != null).
void keep_hidden(const Scratch& s, int64_t n, double* a, double* dg, double* du) {
  if (!a) return;
  std::copy_n(s.a.begin(), n, a);
  std::copy_n(s.g.begin(), n, dg);
  std::copy_n(s.u.begin(), n, du);
}

// One token's input gradients, in the order shared, then j = 0..k-1; backward() sums the weight
// gradients from what it keeps (weight_gradients below).
template <class Src>
void backward_row(const Layer<Src>& L, int64_t t, const double* dy_row, Scratch& s, double* dx_row,
                  double* d_topk_row, const SlotOutputs& out) {
  std::fill(dx_row, dx_row + L.H, 0.0);
  s.load_x(L, t);
  if (L.I_shared > 0) {
    ffn_backward(shared(L), L.H, 1.0, dy_row, s, dx_row, nullptr);
    keep_hidden(s, L.I_shared, out.shared_a, out.shared_dg, out.shared_du);
  }
  for (int64_t j = 0; j < L.k; ++j) {
    const int64_t e = expert_of(L, t, j);
    if (e < 0) {  // not routed
      d_topk_row[j] = 0.0;
      continue;
    }
    double* dw_factors = out.dw_factors ? out.dw_factors + kDwFactors * j : nullptr;
    d_topk_row[j] = ffn_backward(routed(L, e), L.H, L.topk_weights[t * L.k + j], dy_row, s, dx_row, dw_factors);
    if (out.magnitude) {
      out.magnitude[j] = s.d_scale_magnitude;
      out.term_rss[j] = s.d_scale_term_rss;
    }
    if (out.a) keep_hidden(s, L.I, out.a + j * L.I, out.dg + j * L.I, out.du + j * L.I);
  }
}

// Every slot's expert checked, in token order, before any thread starts: the first id out of range
// throws as expert_of does, from the caller's thread.
template <class Src>
void check_ids(const Layer<Src>& L) {
  for (int64_t t = 0; t < L.T; ++t)
    for (int64_t j = 0; j < L.k; ++j) expert_of(L, t, j);
}

// parallel_for with a Scratch for each thread: body(i, scratch). Each i writes only outputs of its own,
// computed in a fixed order, so the results are the same whichever thread takes it.
template <class Src, class F>
void for_each_parallel(const Layer<Src>& L, int64_t n, int threads, const F& body) {
  std::vector<Scratch> scratch(parallel_threads(n, threads), Scratch(L));
  parallel_for(n, threads, [&](int64_t i, int64_t worker) { body(i, scratch[worker]); });
}

// A term of one FFN's weight gradients: its token, router weight (1 for the shared expert), and the a,
// dg and du its backward_row kept.
struct Term {
  int64_t t;
  double scale;
  const double *a, *dg, *du;
};

// One FFN's weight gradients for its intermediate rows [i0, i1): dw_down's columns and dw_gate's and
// dw_up's rows, each element summed over the terms in the order given (token order, then j), as one
// pass over the tokens would sum it.
template <class Src>
void weight_gradients(const Layer<Src>& L, const std::vector<Term>& terms, int64_t n, int64_t i0, int64_t i1,
                      const double* dy, Scratch& s, const FfnGrads& grads) {
  const int64_t H = L.H;
  for (const Term& term : terms) {
    s.load_x(L, term.t);
    const double* dy_row = dy + term.t * H;
    for (int64_t h = 0; h < H; ++h) {
      const double c = term.scale * dy_row[h];
      for (int64_t i = i0; i < i1; ++i) grads.down[h * n + i] += c * term.a[i];
    }
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t h = 0; h < H; ++h) {
        grads.gate[i * H + h] += term.dg[i] * s.x[h];
        grads.up[i * H + h] += term.du[i] * s.x[h];
      }
  }
}

}  // namespace

template <class Src>
std::vector<double> forward(const Layer<Src>& layer, int threads) {
  check_ids(layer);
  std::vector<double> y(layer.T * layer.H);
  for_each_parallel(layer, layer.T, threads,
                    [&](int64_t t, Scratch& s) { forward_row(layer, t, s, y.data() + t * layer.H); });
  return y;
}

template <class Src>
void forward_token(const Layer<Src>& layer, int64_t t, double* y_row) {
  Scratch s(layer);
  forward_row(layer, t, s, y_row);
}

template <class Src>
Gradients backward(const Layer<Src>& layer, const double* dy, int threads) {
  const int64_t T = layer.T, H = layer.H, I = layer.I, E = layer.E, k = layer.k, Is = layer.I_shared;
  Gradients g;
  g.dx.assign(T * H, 0.0);
  g.d_topk_weights.assign(T * k, 0.0);
  g.d_topk_magnitude.assign(T * k, 0.0);
  g.d_topk_term_rss.assign(T * k, 0.0);
  g.dw_gate.assign(E * I * H, 0.0);
  g.dw_up.assign(E * I * H, 0.0);
  g.dw_down.assign(E * H * I, 0.0);
  g.dw_term_square.assign(3 * E, 0.0);
  g.dws_gate.assign(Is * H, 0.0);
  g.dws_up.assign(Is * H, 0.0);
  g.dws_down.assign(H * Is, 0.0);
  check_ids(layer);
  // The input gradients a token at a time, keeping each slot's factors of dw_term_square and its a, dg, du.
  std::vector<double> dw_factors(kDwFactors * T * k), a(T * k * I), dg(T * k * I), du(T * k * I);
  std::vector<double> shared_a(T * Is), shared_dg(T * Is), shared_du(T * Is);
  for_each_parallel(layer, T, threads, [&](int64_t t, Scratch& s) {
    const SlotOutputs out{g.d_topk_magnitude.data() + t * k, g.d_topk_term_rss.data() + t * k,
                          dw_factors.data() + kDwFactors * t * k, a.data() + t * k * I,
                          dg.data() + t * k * I,             du.data() + t * k * I,
                          shared_a.data() + t * Is,          shared_dg.data() + t * Is,
                          shared_du.data() + t * Is};
    backward_row(layer, t, dy + t * H, s, g.dx.data() + t * H, g.d_topk_weights.data() + t * k, out);
  });
  // Each expert's terms in token order, and dw_term_square summed over them in that order.
  std::vector<std::vector<Term>> expert_terms(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = expert_of(layer, t, j), slot = t * k + j;
      if (e < 0) continue;
      expert_terms[e].push_back({t, layer.topk_weights[slot], a.data() + slot * I, dg.data() + slot * I,
                                 du.data() + slot * I});
      const double* f = dw_factors.data() + kDwFactors * slot;
      g.dw_term_square[3 * e] += f[0] * f[2];
      g.dw_term_square[3 * e + 1] += f[1] * f[2];
      g.dw_term_square[3 * e + 2] += f[3] * f[4];
    }
  std::vector<Term> shared_terms(Is > 0 ? T : 0);
  for (int64_t t = 0; t < int64_t(shared_terms.size()); ++t)
    shared_terms[t] = {t, 1.0, shared_a.data() + t * Is, shared_dg.data() + t * Is, shared_du.data() + t * Is};
  // The weight gradients in pieces of kRowsAPiece intermediate rows of one FFN (the routed experts',
  // then the shared one's), a piece at a time.
  constexpr int64_t kRowsAPiece = 16;
  const int64_t routed_pieces = (I + kRowsAPiece - 1) / kRowsAPiece, shared_pieces = (Is + kRowsAPiece - 1) / kRowsAPiece;
  for_each_parallel(layer, E * routed_pieces + shared_pieces, threads, [&](int64_t piece, Scratch& s) {
    if (piece < E * routed_pieces) {
      const int64_t e = piece / routed_pieces, i0 = piece % routed_pieces * kRowsAPiece;
      const FfnGrads grads{g.dw_gate.data() + e * I * H, g.dw_up.data() + e * I * H, g.dw_down.data() + e * H * I};
      weight_gradients(layer, expert_terms[e], I, i0, std::min(i0 + kRowsAPiece, I), dy, s, grads);
    } else {
      const int64_t i0 = (piece - E * routed_pieces) * kRowsAPiece;
      const FfnGrads grads{g.dws_gate.data(), g.dws_up.data(), g.dws_down.data()};
      weight_gradients(layer, shared_terms, Is, i0, std::min(i0 + kRowsAPiece, Is), dy, s, grads);
    }
  });
  return g;
}

template <class Src>
void backward_token(const Layer<Src>& layer, int64_t t, const double* dy_row, double* dx_row,
                    double* d_topk_row) {
  Scratch s(layer);
  backward_row(layer, t, dy_row, s, dx_row, d_topk_row, SlotOutputs{});
}

#define LYNX_REF_INSTANTIATE(Src)                                                                 \
  template std::vector<double> forward<Src>(const Layer<Src>&, int);                              \
  template void forward_token<Src>(const Layer<Src>&, int64_t, double*);                          \
  template Gradients backward<Src>(const Layer<Src>&, const double*, int);                        \
  template void backward_token<Src>(const Layer<Src>&, int64_t, const double*, double*, double*);

LYNX_REF_INSTANTIATE(double)
LYNX_REF_INSTANTIATE(lynx::HostBf16)
#undef LYNX_REF_INSTANTIATE

}  // namespace lynx::ref
