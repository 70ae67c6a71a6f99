// Fused CPU kernels for moelab's sparse probability maps and LapSum.
//
// Each kernel works on a contiguous (rows, n) matrix, one row at a time, in
// parallel over rows. Rows are short (n = number of experts, 8-256), so a row
// lives in L1 and every map costs a handful of passes over it with no sort of
// the whole row:
//
//   sparsemax, 2-normmax, 1.5-entmax: only scores within the map's singleton
//   threshold of the row maximum can be in the support (sparsemax, normmax:
//   z_i > max - 1; 1.5-entmax: z_i > max - 2). Those candidates, usually a
//   few, are sorted and the exact sort-based threshold is computed on them.
//
//   LapSum: the threshold x solving sum_i F((z_i - x)/t) = k is found by the
//   finite, monotone partition iteration described in moelab/maps/lapsum.py.
//
// The Python side (moelab/maps/*.py) holds the plain-PyTorch reference of
// every kernel; tests compare the two in float64.
//
// Every forward kernel reports a per-row status instead of producing NaN:
//   0 ok, 1 NaN or +inf score, 2 all scores -inf, 3 k outside (0, #finite).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace moelab {
namespace {

constexpr int kOk = 0;
constexpr int kBadValue = 1;
constexpr int kAllMasked = 2;
constexpr int kBadK = 3;

enum class Sparse { kSparsemax = 0, kEntmax15 = 1, kNormmax2 = 2 };

// Bit-level test for NaN or +inf: stays correct whatever the floating-point flags.
inline bool bad_value(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return (b & 0x7fffffffu) >= 0x7f800000u && b != 0xff800000u;
}
inline bool bad_value(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return (b & 0x7fffffffffffffffull) >= 0x7ff0000000000000ull && b != 0xfff0000000000000ull;
}

// Row maximum, and a status for rows the maps cannot take.
template <typename scalar_t>
inline int row_max(const scalar_t* z, int64_t n, scalar_t& zmax) {
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  scalar_t m = -inf;
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t v = z[i];
    bad |= bad_value(v) ? 1 : 0;
    m = v > m ? v : m;
  }
  zmax = m;
  if (bad) return kBadValue;
  if (m == -inf) return kAllMasked;
  return kOk;
}

// exp(x) for x <= 0, written so that loops over it vectorise (the libm call
// does not). Range reduction x = n ln2 + r, |r| <= ln2/2, then a Taylor
// polynomial: degree 7 for float (< 2 ulp), 13 for double. Below the smallest
// normal number it returns 0; -inf gives 0.
template <typename T>
inline T exp_nonpos(T x);

template <>
__attribute__((always_inline)) inline float exp_nonpos<float>(float x) {
  const bool tiny = !(x > -87.0f);  // also true for -inf and NaN
  x = tiny ? 0.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

template <>
__attribute__((always_inline)) inline double exp_nonpos<double>(double x) {
  const bool tiny = !(x > -708.0);
  x = tiny ? 0.0 : x;
  const double n = std::nearbyint(x * 1.4426950408889634074);
  const double r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t e = (static_cast<int64_t>(n) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? 0.0 : p * scale;
}

// Rows are short, so a row-at-a-time kernel spends its time on the latency of
// one scalar step after another. The forward kernels instead take a block of
// kLanes rows, transpose it into a (n, kLanes) buffer, and run every per-row
// step across the lanes as one vector operation. A block iterates until all
// its rows are done; finished lanes keep their result.
template <typename scalar_t>
constexpr int64_t kLanes = 64 / sizeof(scalar_t);  // one 512-bit vector

// Load rows [r0, r0 + nl) of z (rows of length n) into buf[j * L + l];
// padding lanes get a harmless constant row.
template <typename scalar_t>
inline void load_block(const scalar_t* z, int64_t n, int64_t r0, int64_t nl, scalar_t* buf) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < L; ++l) {
    const scalar_t* zr = z + (r0 + l) * n;
    for (int64_t j = 0; j < n; ++j) buf[j * L + l] = l < nl ? zr[j] : scalar_t(0);
  }
}

template <typename scalar_t>
inline void store_block(const scalar_t* buf, int64_t n, int64_t r0, int64_t nl, scalar_t* p) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < nl; ++l) {
    scalar_t* pr = p + (r0 + l) * n;
    for (int64_t j = 0; j < n; ++j) pr[j] = buf[j * L + l];
  }
}

// Per-lane maximum and status; rows the maps cannot take are replaced by zeros
// in the buffer so that the shared iteration stays finite.
template <typename scalar_t>
inline void block_max(scalar_t* buf, int64_t n, scalar_t* mx, int32_t* code) {
  constexpr int64_t L = kLanes<scalar_t>;
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  int32_t bad[L];
  for (int64_t l = 0; l < L; ++l) {
    mx[l] = -inf;
    bad[l] = 0;
  }
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t v = buf[j * L + l];
      bad[l] |= bad_value(v) ? 1 : 0;
      mx[l] = v > mx[l] ? v : mx[l];
    }
  }
  bool any_bad = false;
  for (int64_t l = 0; l < L; ++l) {
    code[l] = bad[l] ? kBadValue : (mx[l] == -inf ? kAllMasked : kOk);
    any_bad |= code[l] != kOk;
  }
  if (any_bad) {
    for (int64_t l = 0; l < L; ++l) {
      if (code[l] == kOk) continue;
      for (int64_t j = 0; j < n; ++j) buf[j * L + l] = scalar_t(0);
      mx[l] = scalar_t(0);
    }
  }
}

// Sparse maps, sort-free and exact.
//
// Work with y = z - max(z) (halved for 1.5-entmax, whose map is (z/2 - tau)_+^2).
// Every map here thresholds y at the tau solving f(tau) = 1 with
//     sparsemax:                 f(tau) = sum_i (y_i - tau)_+
//     1.5-entmax and 2-normmax:  f(tau) = sum_i (y_i - tau)_+^2
// f is convex and decreasing, and f(-1) >= 1 from the maximum alone, so
// tau = -1 is a lower bound and no y_i <= -1 is ever in the support (this is
// the threshold law: the runner-up is zero iff its gap reaches the threshold).
// From a lower bound lo, one pass over the row gives, for S = {y > lo},
//     K = |S|,  D1 = sum_S (y - lo),  D2 = sum_S (y - lo)^2,  m = min_S (y - lo).
// The threshold of the map restricted to S is then closed-form (lo + step), and
// it is the answer exactly when every member of S lies above it (m > step):
// S contains the true support, and equals it precisely then. Otherwise a
// Newton step on f from lo is a new, tighter lower bound (for sparsemax the
// Newton step and the closed form coincide: this is Michelot's algorithm).
// Rows need 2-4 passes in practice.
// One pass of the sparse threshold iteration over a block: for S = {y > lo},
// per lane, K = |S|, D1 = sum_S (y - lo), D2 = sum_S (y - lo)^2, m = min_S (y - lo).
// NOTE: kept out of line: inlined into the block loop, GCC 12 stops vectorising it.
template <typename scalar_t, Sparse M>
__attribute__((noinline)) void sparse_pass(const scalar_t* __restrict buf,
                                           const scalar_t* __restrict lo,
                                           scalar_t* __restrict kf, scalar_t* __restrict d1,
                                           scalar_t* __restrict d2, scalar_t* __restrict mn,
                                           int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < L; ++l) {
    kf[l] = d1[l] = d2[l] = scalar_t(0);
    mn[l] = std::numeric_limits<scalar_t>::infinity();
  }
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t d = buf[j * L + l] - lo[l];
      const bool in = d > scalar_t(0);
      kf[l] += in ? scalar_t(1) : scalar_t(0);
      d1[l] += in ? d : scalar_t(0);
      if constexpr (M != Sparse::kSparsemax) d2[l] += in ? d * d : scalar_t(0);
      mn[l] = (in && d < mn[l]) ? d : mn[l];
    }
  }
}

template <typename scalar_t, Sparse M>
void sparse_forward_impl(const at::Tensor& z, at::Tensor& p, at::Tensor& status) {
  constexpr int64_t L = kLanes<scalar_t>;
  const int64_t rows = z.size(0), n = z.size(1);
  const int64_t blocks = (rows + L - 1) / L;
  const scalar_t* zp = z.const_data_ptr<scalar_t>();
  scalar_t* pp = p.mutable_data_ptr<scalar_t>();
  int32_t* st = status.mutable_data_ptr<int32_t>();
  const scalar_t half = (M == Sparse::kEntmax15) ? scalar_t(0.5) : scalar_t(1);
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> storage(n * L);
    scalar_t* buf = storage.data();
    scalar_t mx[L], lo[L], tau[L], kf[L], d1[L], d2[L], mn[L];
    int32_t code[L];
    bool done[L];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * L, nl = std::min(L, rows - r0);
      load_block(zp, n, r0, nl, buf);
      block_max(buf, n, mx, code);
      for (int64_t l = 0; l < nl; ++l) st[r0 + l] = code[l];
      // NOTE: y = (z - max) first, then the halving, so that the runner-up's
      // gap is the one the caller computes and the threshold law is exact.
      for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) buf[j * L + l] = (buf[j * L + l] - mx[l]) * half;
      }
      for (int64_t l = 0; l < L; ++l) {
        lo[l] = scalar_t(-1);
        tau[l] = scalar_t(-1);
        done[l] = false;
      }
      for (int64_t pass = 0; pass <= n + 1; ++pass) {
        sparse_pass<scalar_t, M>(buf, lo, kf, d1, d2, mn, n);
        bool all_done = true;
#pragma omp simd reduction(& : all_done)
        for (int64_t l = 0; l < L; ++l) {
          scalar_t step, newton;
          if constexpr (M == Sparse::kSparsemax) {
            step = (d1[l] - scalar_t(1)) / kf[l];
            newton = step;
          } else {
            const scalar_t e = d2[l] - scalar_t(1);
            newton = e / (scalar_t(2) * d1[l]);
            const scalar_t disc = d1[l] * d1[l] - kf[l] * e;
            // smaller root of sum_S (d - step)^2 = 1, in cancellation-free form
            step = disc >= scalar_t(0) ? e / (d1[l] + std::sqrt(disc > 0 ? disc : 0)) : inf;
          }
          const scalar_t next = lo[l] + newton;
          const bool exact = mn[l] > step;
          const bool stuck = !(next > lo[l]);  // rounding floor reached
          const bool fin = !done[l] && (exact || stuck);
          tau[l] = fin ? lo[l] + step : tau[l];
          lo[l] = (done[l] || fin) ? lo[l] : next;
          done[l] = done[l] || fin;
          all_done = all_done && done[l];
        }
        if (all_done) break;
      }
      if constexpr (M == Sparse::kNormmax2) {
        scalar_t total[L];
        for (int64_t l = 0; l < L; ++l) total[l] = scalar_t(0);
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) {
            const scalar_t u = buf[j * L + l] - tau[l];
            const scalar_t v = u > scalar_t(0) ? u : scalar_t(0);
            buf[j * L + l] = v;
            total[l] += v;
          }
        }
        for (int64_t l = 0; l < L; ++l) total[l] = scalar_t(1) / total[l];
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) buf[j * L + l] *= total[l];
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) {
            const scalar_t u = buf[j * L + l] - tau[l];
            const scalar_t v = u > scalar_t(0) ? u : scalar_t(0);
            buf[j * L + l] = (M == Sparse::kEntmax15) ? v * v : v;
          }
        }
      }
      for (int64_t l = 0; l < nl; ++l)
        if (code[l] != kOk)
          for (int64_t j = 0; j < n; ++j) buf[j * L + l] = scalar_t(0);
      store_block(buf, n, r0, nl, pp);
    }
  });
}

template <typename scalar_t, Sparse M>
void sparse_backward_impl(const at::Tensor& p, const at::Tensor& g, at::Tensor& dz) {
  const int64_t rows = p.size(0), n = p.size(1);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = g.const_data_ptr<scalar_t>();
  scalar_t* dp = dz.mutable_data_ptr<scalar_t>();
  const scalar_t zero(0);
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* pr = pp + r * n;
      const scalar_t* gr = gp + r * n;
      scalar_t* dr = dp + r * n;
      if constexpr (M == Sparse::kSparsemax) {
        // J = diag(s) - s s^T / |S|,  s = 1[p > 0]
        scalar_t gsum = 0, count = 0;
#pragma omp simd reduction(+ : gsum, count)
        for (int64_t i = 0; i < n; ++i) {
          const bool in = pr[i] > zero;
          gsum += in ? gr[i] : zero;
          count += in ? scalar_t(1) : zero;
        }
        const scalar_t mean = gsum / count;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dr[i] = pr[i] > zero ? gr[i] - mean : zero;
      } else if constexpr (M == Sparse::kEntmax15) {
        // J = diag(s) - s s^T / sum(s),  s = p^(2 - alpha) = sqrt(p)
        scalar_t ssum = 0, sg = 0;
#pragma omp simd reduction(+ : ssum, sg)
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t s = std::sqrt(pr[i]);
          ssum += s;
          sg += s * gr[i];
        }
        const scalar_t q = sg / ssum;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dr[i] = std::sqrt(pr[i]) * (gr[i] - q);
      } else {
        // 2-normmax: p = u / S, u = (z - tau)_+, sum u^2 = 1, hence 1/S = ||p||_2.
        //   h = (g - <g, p>) / S,   dz = h 1[p > 0] - (sum_{p > 0} h) p
        scalar_t pp2 = 0, gpd = 0, gs = 0, cnt = 0;
#pragma omp simd reduction(+ : pp2, gpd, gs, cnt)
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t pi = pr[i];
          const bool in = pi > zero;
          pp2 += pi * pi;
          gpd += pi * gr[i];
          gs += in ? gr[i] : zero;
          cnt += in ? scalar_t(1) : zero;
        }
        const scalar_t inv_s = std::sqrt(pp2);
        const scalar_t hsum = (gs - cnt * gpd) * inv_s;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t pi = pr[i];
          dr[i] = pi > zero ? (gr[i] - gpd) * inv_s - hsum * pi : zero;
        }
      }
    }
  });
}

// LapSum. F(y) = exp(y)/2 for y <= 0 and 1 - exp(-y)/2 for y > 0 (Laplace CDF),
// and F = min(exp(y)/2, 1 - exp(-y)/2). For any split of the scores into a
// group "above c" and a group "below c", summing the matching branch per group
// bounds sum_i F((z_i - x)/t) from above, with equality when the split is the
// one at x itself. For a fixed split the bound equals k where
//     A e^{-x/t} + n_above - B e^{x/t} = k,
// a quadratic in u = e^{x/t}. Starting from c = max(z) and re-splitting at each
// solution moves x down monotonically and stops, exactly, once the split no
// longer changes (at most n + 1 rounds; 2-4 in practice). One pass per round
// computes q_i = exp(-|z_i - c|/t) and A, B relative to c; the pass that finds
// the split unchanged has computed the output's q already.
// NOTE: when a group lies so far from c that its sum underflows, the round is
// redone with each group's sum shifted by its member nearest to c, so widely
// separated scores (large gaps, small t) stay exact instead of collapsing.
inline double lapsum_log_u(double kk, double above, double log_a, double log_b) {
  // Solve A/u + n_above - B u = k for log u, stably for every sign of k - n_above.
  const double dk = kk - above;
  if (dk == 0.0) return 0.5 * (log_a - log_b);
  const double ad = std::abs(dk);
  const double w = std::exp(std::min(log_a + log_b - 2.0 * std::log(ad), 700.0));
  const double root = ad * std::sqrt(1.0 + 4.0 * w);  // sqrt(dk^2 + 4AB)
  return dk > 0.0 ? std::log(2.0) + log_a - std::log(ad + root)
                  : std::log(ad + root) - std::log(2.0) - log_b;
}

// One LapSum round over a block: q = exp(-|z - c|/t), the size of the group
// above c, and the sums of q below (a) and above (b) c, per lane.
// NOTE: kept out of line for the same reason as sparse_pass.
template <typename scalar_t>
__attribute__((noinline)) void lapsum_pass(const scalar_t* __restrict zb, scalar_t* __restrict qb,
                 const scalar_t* __restrict c, const scalar_t* __restrict inv_t,
                 scalar_t* __restrict a, scalar_t* __restrict b, scalar_t* __restrict above,
                 int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < L; ++l) a[l] = b[l] = above[l] = scalar_t(0);
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t d = zb[j * L + l] - c[l];
      const bool up = d > scalar_t(0);
      const scalar_t q = exp_nonpos<scalar_t>(-std::abs(d) * inv_t[l]);
      qb[j * L + l] = q;  // a finished lane keeps its c, so q is unchanged
      above[l] += up ? scalar_t(1) : scalar_t(0);
      a[l] += up ? scalar_t(0) : q;
      b[l] += up ? q : scalar_t(0);
    }
  }
}

// The same round without exponentials. With e_i = exp((z_i - max)/t), computed
// once, and the split point carried as C = exp((max - c)/t): z_i > c iff
// e_i > 1/C, and q_i = e_i C below the split, 1/(e_i C) above it.
template <typename scalar_t>
__attribute__((noinline)) void lapsum_pass_scaled(
    const scalar_t* __restrict eb, const scalar_t* __restrict rb, scalar_t* __restrict qb,
    const scalar_t* __restrict scale, const scalar_t* __restrict inv_scale,
    scalar_t* __restrict a, scalar_t* __restrict b, scalar_t* __restrict above, int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < L; ++l) a[l] = b[l] = above[l] = scalar_t(0);
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t e = eb[j * L + l];
      const bool up = e > inv_scale[l];
      const scalar_t q = up ? inv_scale[l] * rb[j * L + l] : e * scale[l];  // rb = 1/e
      qb[j * L + l] = q;
      above[l] += up ? scalar_t(1) : scalar_t(0);
      a[l] += up ? scalar_t(0) : q;
      b[l] += up ? q : scalar_t(0);
    }
  }
}

template <typename scalar_t>
void lapsum_forward_impl(const at::Tensor& z, const at::Tensor& k, const at::Tensor& t,
                         at::Tensor& p, at::Tensor& x_out, at::Tensor& status) {
  constexpr int64_t L = kLanes<scalar_t>;
  const int64_t rows = z.size(0), n = z.size(1);
  const int64_t blocks = (rows + L - 1) / L;
  const scalar_t* zp = z.const_data_ptr<scalar_t>();
  const scalar_t* kp = k.const_data_ptr<scalar_t>();
  const scalar_t* tp = t.const_data_ptr<scalar_t>();
  scalar_t* pp = p.mutable_data_ptr<scalar_t>();
  scalar_t* xp = x_out.mutable_data_ptr<scalar_t>();
  int32_t* st = status.mutable_data_ptr<int32_t>();
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  const scalar_t tiny = scalar_t(1e3) * std::numeric_limits<scalar_t>::min();
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> zs(n * L), qs(n * L), es(n * L), rs(n * L);
    scalar_t* zb = zs.data();
    scalar_t* qb = qs.data();
    scalar_t* eb = es.data();
    scalar_t* rb = rs.data();
    scalar_t mx[L], c[L], inv_t[L], a[L], b[L], above[L], prev[L], lo_max[L], hi_min[L];
    scalar_t scale[L], inv_scale[L];
    int32_t code[L];
    bool done[L];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * L, nl = std::min(L, rows - r0);
      load_block(zp, n, r0, nl, zb);
      // The number of finite scores bounds k; count before bad rows are zeroed.
      scalar_t finite[L];
      for (int64_t l = 0; l < L; ++l) finite[l] = scalar_t(0);
      for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) finite[l] += zb[j * L + l] > -inf ? scalar_t(1) : scalar_t(0);
      }
      block_max(zb, n, mx, code);
      for (int64_t l = 0; l < L; ++l) {
        const scalar_t kk = l < nl ? kp[r0 + l] : scalar_t(1);
        const scalar_t tt = l < nl ? tp[r0 + l] : scalar_t(1);
        if (code[l] == kOk && l < nl && !(kk > scalar_t(0) && kk < finite[l])) {
          code[l] = kBadK;
          for (int64_t j = 0; j < n; ++j) zb[j * L + l] = scalar_t(0);
        }
        inv_t[l] = scalar_t(1) / tt;
        c[l] = code[l] == kOk ? mx[l] : scalar_t(0);
        prev[l] = scalar_t(-1);
        done[l] = code[l] != kOk || l >= nl;
      }
      for (int64_t l = 0; l < nl; ++l) st[r0 + l] = code[l];
      // Typical rows: rounds in e-space, e = exp((z - max)/t) <= 1 computed once,
      // the split carried as C = exp((max - c)/t). The root of a split's quadratic
      // is then a ratio u = exp((x - c)/t) and moves C to C/u: no exponential or
      // logarithm per round.
      // NOTE: exact only while no finite e underflows and C stays finite, so
      // rows spread over more than `reach` temperatures (or whose x runs that
      // far below the maximum) take the log-domain rounds below instead.
      const scalar_t reach = static_cast<scalar_t>(
          std::log(static_cast<double>(std::numeric_limits<scalar_t>::max())) - 8.0);
      const scalar_t big = std::exp(reach);
      scalar_t lowest[L], kl[L];
      for (int64_t l = 0; l < L; ++l) {
        lowest[l] = a[l] = b[l] = above[l] = scalar_t(0);
        kl[l] = l < nl ? kp[r0 + l] : scalar_t(1);
        scale[l] = inv_scale[l] = scalar_t(1);
      }
      // This pass is also round 0: at c = max every score is in the lower group.
      for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const scalar_t v = zb[j * L + l];
          const scalar_t u = (v - mx[l]) * inv_t[l];
          const scalar_t e = exp_nonpos<scalar_t>(u);
          eb[j * L + l] = e;
          rb[j * L + l] = scalar_t(1) / e;  // inf for masked scores, never used
          a[l] += e;
          lowest[l] = (v > -inf && u < lowest[l]) ? u : lowest[l];
        }
      }
      bool scaled = true;
      for (int64_t l = 0; l < L; ++l) scaled = scaled && (done[l] || -lowest[l] < reach);
      bool filled = false;  // whether qb holds q at the current split
      if (scaled) {
        for (int64_t round = 0; round <= n + 1; ++round) {
          if (round > 0) {
            lapsum_pass_scaled<scalar_t>(eb, rb, qb, scale, inv_scale, a, b, above, n);
            filled = true;
          }
          bool all_done = true, overflow = false;
#pragma omp simd reduction(& : all_done) reduction(| : overflow)
          for (int64_t l = 0; l < L; ++l) {
            const bool fin = done[l] || above[l] == prev[l];  // split unchanged: exact
            prev[l] = above[l];
            // A/u + n_above - B u = k with A = a/2, B = b/2, stably for each sign of dk
            const scalar_t A = scalar_t(0.5) * a[l], B = scalar_t(0.5) * b[l];
            const scalar_t dk = kl[l] - above[l];
            const scalar_t root = std::sqrt(dk * dk + scalar_t(4) * A * B);
            const scalar_t u = dk > scalar_t(0)   ? scalar_t(2) * A / (dk + root)
                               : dk < scalar_t(0) ? (root - dk) / (scalar_t(2) * B)
                                                  : std::sqrt(A / B);
            const scalar_t next = fin ? scale[l] : scale[l] / u;
            overflow = overflow || !(next < big);
            const bool same = next == scale[l];  // converged to rounding
            scale[l] = next;
            inv_scale[l] = fin ? inv_scale[l] : inv_scale[l] * u;
            done[l] = fin || same;
            all_done = all_done && done[l];
          }
          if (overflow) {
            scaled = false;
            break;
          }
          if (all_done) break;
        }
      }
      if (scaled && !filled)  // every lane solved in round 0: q at the final split
        lapsum_pass_scaled<scalar_t>(eb, rb, qb, scale, inv_scale, a, b, above, n);
      if (scaled) {
        for (int64_t l = 0; l < L; ++l)
          c[l] = static_cast<scalar_t>(static_cast<double>(mx[l]) +
                                       std::log(static_cast<double>(inv_scale[l])) /
                                           static_cast<double>(inv_t[l]));
      } else {
        for (int64_t l = 0; l < L; ++l) {
          c[l] = code[l] == kOk ? mx[l] : scalar_t(0);
          prev[l] = scalar_t(-1);
          done[l] = code[l] != kOk || l >= nl;
        }
      }
      // Widely spread rows: rounds in the log domain around c itself.
      for (int64_t round = 0; !scaled && round <= n + 1; ++round) {
        lapsum_pass<scalar_t>(zb, qb, c, inv_t, a, b, above, n);
        bool all_done = true, need_shift = false;
        for (int64_t l = 0; l < L; ++l) {
          // split unchanged: c is the exact root, and qb holds its q
          if (!done[l] && above[l] == prev[l]) done[l] = true;
          prev[l] = above[l];
          all_done = all_done && done[l];
          need_shift |= !done[l] && (a[l] < tiny || (above[l] > 0 && b[l] < tiny));
        }
        if (all_done) break;
        double log_a[L], log_b[L];
        for (int64_t l = 0; l < L; ++l) {
          log_a[l] = std::log(0.5 * static_cast<double>(a[l]));
          log_b[l] = std::log(0.5 * static_cast<double>(b[l]));
        }
        if (need_shift) {
          // a' = sum_below exp((z - lo_max)/t), b' = sum_above exp((hi_min - z)/t)
          for (int64_t l = 0; l < L; ++l) {
            lo_max[l] = -inf;
            hi_min[l] = inf;
            a[l] = b[l] = scalar_t(0);
          }
          for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) {
              const scalar_t v = zb[j * L + l];
              const bool up = v > c[l];
              lo_max[l] = (!up && v > lo_max[l]) ? v : lo_max[l];
              hi_min[l] = (up && v < hi_min[l]) ? v : hi_min[l];
            }
          }
          for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
            for (int64_t l = 0; l < L; ++l) {
              const scalar_t v = zb[j * L + l];
              const bool up = v > c[l];
              const scalar_t e = exp_nonpos<scalar_t>(up ? (hi_min[l] - v) * inv_t[l]
                                                         : (v - lo_max[l]) * inv_t[l]);
              a[l] += up ? scalar_t(0) : e;
              b[l] += up ? e : scalar_t(0);
            }
          }
          for (int64_t l = 0; l < L; ++l) {
            const double td = 1.0 / static_cast<double>(inv_t[l]);
            log_a[l] = std::log(0.5 * static_cast<double>(a[l])) +
                       (static_cast<double>(lo_max[l]) - c[l]) / td;
            log_b[l] = above[l] > 0 ? std::log(0.5 * static_cast<double>(b[l])) +
                                          (c[l] - static_cast<double>(hi_min[l])) / td
                                    : -std::numeric_limits<double>::infinity();
          }
        }
        for (int64_t l = 0; l < L; ++l) {
          if (done[l]) continue;
          const double td = l < nl ? static_cast<double>(tp[r0 + l]) : 1.0;
          const double logu = lapsum_log_u(static_cast<double>(kp[r0 + l]), above[l], log_a[l], log_b[l]);
          const scalar_t next = static_cast<scalar_t>(static_cast<double>(c[l]) + td * logu);
          if (next == c[l]) {
            done[l] = true;  // converged to rounding; qb holds q at c
          } else {
            c[l] = next;
          }
        }
      }
      // p_i = F((z_i - x)/t) from q_i = exp(-|z_i - x|/t), computed at c = x.
      scalar_t total[L], fsum[L], delta[L], ok[L];
      for (int64_t l = 0; l < L; ++l) {
        total[l] = fsum[l] = delta[l] = scalar_t(0);
        ok[l] = code[l] == kOk ? scalar_t(1) : scalar_t(0);  // rows with an error get 0
      }
      for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const scalar_t q = scalar_t(0.5) * qb[j * L + l];
          const bool up = scaled ? eb[j * L + l] > inv_scale[l] : zb[j * L + l] > c[l];
          const scalar_t v = (up ? scalar_t(1) - q : q) * ok[l];
          qb[j * L + l] = v;
          total[l] += v;
          fsum[l] += q;  // F' = min(p, 1 - p) = q / 2
        }
      }
      // NOTE: x is a float near the scores; when they are large (|z| ~ 1e4 in
      // float32) its rounding alone moves sum(p) off k. One Newton step gives a
      // correction delta that is applied to the exact differences z - x, i.e.
      // the threshold is carried as x + delta in two numbers.
      bool fix = false;
      for (int64_t l = 0; l < nl; ++l) {
        if (code[l] != kOk) continue;
        const scalar_t kk = kp[r0 + l];
        const scalar_t resid = total[l] - kk;
        const scalar_t tol = scalar_t(16) * std::numeric_limits<scalar_t>::epsilon() *
                             (kk > scalar_t(1) ? kk : scalar_t(1));
        if (std::abs(resid) > tol && fsum[l] > scalar_t(0)) {
          delta[l] = resid * tp[r0 + l] / fsum[l];
          fix = true;
        }
      }
      if (fix) {
        for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
          for (int64_t l = 0; l < L; ++l) {
            const scalar_t d = (zb[j * L + l] - c[l]) - delta[l];
            const scalar_t q = scalar_t(0.5) * exp_nonpos<scalar_t>(-std::abs(d) * inv_t[l]);
            const scalar_t v = (d > scalar_t(0) ? scalar_t(1) - q : q) * ok[l];
            qb[j * L + l] = delta[l] != scalar_t(0) ? v : qb[j * L + l];
          }
        }
      }
      store_block(qb, n, r0, nl, pp);
      for (int64_t l = 0; l < nl; ++l) xp[r0 + l] = code[l] == kOk ? c[l] + delta[l] : scalar_t(0);
    }
  });
}

// Gradients of p_i = F((z_i - x)/t) under sum_i p_i = k, with
// f_i = F'((z_i - x)/t) = min(p_i, 1 - p_i):
//   dL/dz_i = f_i / t * (g_i - gbar),   dL/dk = gbar,   gbar = sum f g / sum f.
template <typename scalar_t>
void lapsum_backward_impl(const at::Tensor& p, const at::Tensor& g, const at::Tensor& t,
                          at::Tensor& dz, at::Tensor& dk) {
  const int64_t rows = p.size(0), n = p.size(1);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = g.const_data_ptr<scalar_t>();
  const scalar_t* tp = t.const_data_ptr<scalar_t>();
  scalar_t* dp = dz.mutable_data_ptr<scalar_t>();
  scalar_t* kp = dk.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* pr = pp + r * n;
      const scalar_t* gr = gp + r * n;
      scalar_t* dr = dp + r * n;
      scalar_t fsum = 0, fg = 0;
#pragma omp simd reduction(+ : fsum, fg)
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t f = pr[i] < scalar_t(0.5) ? pr[i] : scalar_t(1) - pr[i];
        fsum += f;
        fg += f * gr[i];
      }
      // every p at 0 or 1 to machine precision: numerically constant, no gradient
      const scalar_t gbar = fsum > scalar_t(0) ? fg / fsum : scalar_t(0);
      const scalar_t inv_t = scalar_t(1) / tp[r];
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t f = pr[i] < scalar_t(0.5) ? pr[i] : scalar_t(1) - pr[i];
        dr[i] = f * inv_t * (gr[i] - gbar);
      }
      kp[r] = gbar;
    }
  });
}

void check_matrix(const at::Tensor& z, const char* name) {
  TORCH_CHECK(z.dim() == 2 && z.is_contiguous() && z.device().is_cpu(), name,
              ": expected a contiguous 2-D CPU tensor");
  TORCH_CHECK(z.scalar_type() == at::kFloat || z.scalar_type() == at::kDouble, name,
              ": expected float32 or float64");
}

template <Sparse M>
std::tuple<at::Tensor, at::Tensor> sparse_forward(const at::Tensor& z) {
  check_matrix(z, "moelab sparse map");
  at::Tensor p = at::empty_like(z);
  at::Tensor status = at::empty({z.size(0)}, z.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "moelab_sparse_forward",
                             [&] { sparse_forward_impl<scalar_t, M>(z, p, status); });
  return {p, status};
}

template <Sparse M>
at::Tensor sparse_backward(const at::Tensor& p, const at::Tensor& g) {
  check_matrix(p, "moelab sparse map backward");
  at::Tensor gc = g.contiguous().to(p.scalar_type());
  at::Tensor dz = at::empty_like(p);
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "moelab_sparse_backward",
                             [&] { sparse_backward_impl<scalar_t, M>(p, gc, dz); });
  return dz;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_forward(const at::Tensor& z,
                                                              const at::Tensor& k,
                                                              const at::Tensor& t) {
  check_matrix(z, "moelab lapsum");
  TORCH_CHECK(k.numel() == z.size(0) && t.numel() == z.size(0),
              "moelab lapsum: k and t need one value per row");
  at::Tensor kc = k.contiguous().to(z.scalar_type());
  at::Tensor tc = t.contiguous().to(z.scalar_type());
  at::Tensor p = at::empty_like(z);
  at::Tensor x = at::empty({z.size(0)}, z.options());
  at::Tensor status = at::empty({z.size(0)}, z.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "moelab_lapsum_forward",
                             [&] { lapsum_forward_impl<scalar_t>(z, kc, tc, p, x, status); });
  return {p, x, status};
}

std::tuple<at::Tensor, at::Tensor> lapsum_backward(const at::Tensor& p, const at::Tensor& g,
                                                   const at::Tensor& t) {
  check_matrix(p, "moelab lapsum backward");
  at::Tensor gc = g.contiguous().to(p.scalar_type());
  at::Tensor tc = t.contiguous().to(p.scalar_type());
  at::Tensor dz = at::empty_like(p);
  at::Tensor dk = at::empty({p.size(0)}, p.options());
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "moelab_lapsum_backward",
                             [&] { lapsum_backward_impl<scalar_t>(p, gc, tc, dz, dk); });
  return {dz, dk};
}

}  // namespace
}  // namespace moelab

TORCH_LIBRARY(moelab_maps, m) {
  m.def("sparsemax_forward(Tensor z) -> (Tensor, Tensor)",
        &moelab::sparse_forward<moelab::Sparse::kSparsemax>);
  m.def("entmax15_forward(Tensor z) -> (Tensor, Tensor)",
        &moelab::sparse_forward<moelab::Sparse::kEntmax15>);
  m.def("normmax2_forward(Tensor z) -> (Tensor, Tensor)",
        &moelab::sparse_forward<moelab::Sparse::kNormmax2>);
  m.def("sparsemax_backward(Tensor p, Tensor g) -> Tensor",
        &moelab::sparse_backward<moelab::Sparse::kSparsemax>);
  m.def("entmax15_backward(Tensor p, Tensor g) -> Tensor",
        &moelab::sparse_backward<moelab::Sparse::kEntmax15>);
  m.def("normmax2_backward(Tensor p, Tensor g) -> Tensor",
        &moelab::sparse_backward<moelab::Sparse::kNormmax2>);
  m.def("lapsum_forward(Tensor z, Tensor k, Tensor t) -> (Tensor, Tensor, Tensor)",
        &moelab::lapsum_forward);
  m.def("lapsum_backward(Tensor p, Tensor g, Tensor t) -> (Tensor, Tensor)",
        &moelab::lapsum_backward);
}
