// Fused CPU kernels for moelab's sparse probability maps and LapSum.
//
// Each kernel works on a contiguous (rows, n) matrix, in parallel over rows.
// Rows are short (n = number of experts, 8-256), so a row lives in L1 and
// every map costs a handful of passes over it with no sort of the whole row:
//
//   sparsemax, 2-normmax, 1.5-entmax: an exact iteration on the threshold from
//   the one restricted to the two largest scores, usually one pass, along the
//   row for wide rows and across blocks of rows for narrow ones (see "Sparse
//   maps, sort-free and exact" below).
//
//   alpha-entmax and alpha-normmax for any other alpha: the same candidates
//   (y_i > -1), then a safeguarded Newton iteration on the threshold over them
//   (entmax with alpha > 2: the exact support by a binary search on the sorted
//   candidates first; see general_forward_impl).
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
#include <string>
#include <type_traits>
#include <utility>
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
  // n = x / ln 2 rounded to the nearest integer, and its bits, from the bits of
  // x / ln 2 + 1.5 * 2^23 (exact for |n| < 2^22; no rounding instruction needed,
  // which SSE2 lacks: its loops then ran one scalar at a time)
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t e;
  std::memcpy(&e, &shifted, sizeof e);
  e = (e - 0x4b400000 + 127) << 23;  // (the low bits of shifted hold n)
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

template <>
__attribute__((always_inline)) inline double exp_nonpos<double>(double x) {
  const bool tiny = !(x > -708.0);
  x = tiny ? 0.0 : x;
  // n = x / ln 2 rounded to the nearest integer from x / ln 2 + 1.5 * 2^52, whose
  // low mantissa bits then hold n (exact for |n| < 2^51): neither a rounding
  // instruction (SSE2 has none) nor a double -> int64 conversion (AVX2 has none)
  const double shifted = x * 1.4426950408889634074 + 6755399441055744.0;
  const double n = shifted - 6755399441055744.0;
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
  // 2^n from those bits (a conversion from double to int64, which only AVX-512
  // has as a vector instruction, kept the loops over this function scalar on AVX2)
  uint64_t e;
  std::memcpy(&e, &shifted, sizeof e);
  e = (e + 1023) << 52;  // the shift drops all but n + 1023 (1 to 1023 here)
  double scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? 0.0 : p * scale;
}

// Bytes of the kernels' vector types: the widest vector register of the
// instruction set the build targets (-march). GCC does not lower a vector type
// wider than the registers to whole registers: with AVX2, 64-byte vectors
// compiled to 128-bit pieces, scalar compares and stack traffic (forward and
// backward at 16-128 experts took 6-14x torch.softmax's time, against 1.0-2.5x
// with 32-byte vectors on the same AMD EPYC).
#if defined(__AVX512F__)
constexpr int64_t kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int64_t kVecBytes = 32;
#else
constexpr int64_t kVecBytes = 16;  // SSE2, NEON and the rest
#endif

// Rows are short, so a row-at-a-time kernel spends its time on the latency of
// one scalar step after another. The forward kernels of LapSum and of the
// sparse maps on narrow rows instead take a block of kLanes rows, transpose it
// into a (n, kLanes) buffer (transpose_in, transpose_out), and run every
// per-row step across the lanes as one vector operation. A block iterates
// until all its rows are done; finished lanes keep their result.
template <typename scalar_t>
constexpr int64_t kLanes = kVecBytes / sizeof(scalar_t);  // one vector register

// Refinement of the sparse maps' threshold (see "Precision" below): the frame
// moves to the threshold while K |step| exceeds kRefine, one to three times on
// flat rows, at most kMaxRefine (the passes' bound leaves that many for it).
constexpr double kRefine = 2.0;
constexpr int kMaxRefine = 6;
// Vectors per chunk of the sums along a row (rows of up to kChunk vectors are
// summed in one chunk, as before chunks).
constexpr int64_t kChunk = 64;

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
// The first lo is the threshold restricted to the two largest scores (see
// top_start), so that most rows need one pass (1.0-1.6 on average at 8-128
// experts and randn * 2 scores).
//
// Precision: the sums are measured from a point c (the frame; c = lo until the
// support is found), and the outputs are (y - c) - step on S, never y - tau with
// tau = c + step formed as one number. The closed form is exact in exact
// arithmetic from any frame, but in floating point it is as precise as the
// terms it sums: from a frame far below tau the terms are large next to the
// outputs (a flat row of E scores has outputs 1/E, and from the start at -1/2
// every term is 1/2), and the rounding of K such terms, and of the quadratic's
// discriminant D1^2 - K (D2 - 1), whose two parts then nearly cancel, lands on
// the outputs (a flat row of 65536 float32 scores summed to 1.06 for
// sparsemax and 0.37 for 1.5-entmax). So once a pass finds the support, the
// frame moves to its threshold (c += step, S kept: membership is still y > lo)
// and the pass is repeated while K |step| > kRefine: then every term is about
// the size of its output and the rounding of the sum is that of summing the
// outputs themselves. Rows of randn * 2 scores never need this (K |step| stays
// below 3.5 at 8-256 experts); flat and nearly flat rows take one to three
// more passes.
//
// Two layouts. Wide rows are mapped along the vector (sparse_forward_row):
// rows are independent, so the out-of-order core overlaps one row's
// horizontal sums with the next row's work, and each row takes only the
// passes it needs. Narrow rows go by blocks of kLanes rows, each step one
// vector operation across the rows (sparse_forward_lanes); a block takes the
// passes of its slowest row. sparse_forward_impl picks by the row's width.

// Fixed-width vectors (GCC/Clang vector extensions). On rows of 8-128
// entries, the compiler's own vectorisation of a runtime-length loop spends
// more on the row's start and remainder than on the row; with a constant
// length it unrolls the loop whole first and then sums in order, one scalar at
// a time. These loops are written in whole vectors and a scalar remainder.
template <typename T, int64_t W>
struct VecOf {
  typedef T type __attribute__((vector_size(W * sizeof(T))));
};
template <typename T, int64_t W>
using vec_t = typename VecOf<T, W>::type;

template <typename T, int64_t W>
inline vec_t<T, W> vload(const T* p) {
  vec_t<T, W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T, int64_t W>
inline void vstore(T* p, vec_t<T, W> v) {
  std::memcpy(p, &v, sizeof v);
}
// The two halves of a vector (in registers: a copy through memory would keep
// the accumulators of the loops before it in memory too).
template <typename T, int64_t W, std::size_t... I>
inline void halves_at(vec_t<T, W> v, vec_t<T, W / 2>& a, vec_t<T, W / 2>& b,
                      std::index_sequence<I...>) {
  a = __builtin_shufflevector(v, v, I...);
  b = __builtin_shufflevector(v, v, (I + W / 2)...);
}
template <typename T, int64_t W>
inline void halves(vec_t<T, W> v, vec_t<T, W / 2>& a, vec_t<T, W / 2>& b) {
  halves_at<T, W>(v, a, b, std::make_index_sequence<W / 2>{});
}
// A reduction of the lanes by halves: op on the two halves, then on the halves
// of that, down to one lane.
template <typename T, int64_t W, typename Op>
inline T hreduce(vec_t<T, W> v, Op op) {
  if constexpr (W == 1) {
    return v[0];
  } else {
    vec_t<T, W / 2> a, b;
    halves<T, W>(v, a, b);
    return hreduce<T, W / 2>(op(a, b), op);
  }
}
template <typename T, int64_t W>
inline T hsum(vec_t<T, W> v) {
  return hreduce<T, W>(v, [](auto a, auto b) { return a + b; });
}
template <typename T, int64_t W>
inline T hmin(vec_t<T, W> v) {
  return hreduce<T, W>(v, [](auto a, auto b) { return a < b ? a : b; });
}
// The two largest values over the lanes, given each lane's largest (a) and
// second largest (b), by halves; ties count twice.
template <typename T, int64_t W>
inline void htop2(vec_t<T, W> a, vec_t<T, W> b, T& first, T& second) {
  if constexpr (W == 1) {
    first = a[0];
    second = b[0];
  } else {
    vec_t<T, W / 2> a1, a2, b1, b2;
    halves<T, W>(a, a1, a2);
    halves<T, W>(b, b1, b2);
    const vec_t<T, W / 2> lower = a1 < a2 ? a1 : a2, bb = b1 > b2 ? b1 : b2;
    htop2<T, W / 2>(a1 > a2 ? a1 : a2, lower > bb ? lower : bb, first, second);
  }
}

// Calls f with the vector width, in lanes (a std::integral_constant), that
// suits rows of n entries: a whole vector register (kVecBytes) where a row fills
// one, else a half or a quarter of one.
// (Never below 128 bits: W2 and W4 stop there.)
template <typename scalar_t>
constexpr int64_t kRowW = kVecBytes / sizeof(scalar_t);
template <typename scalar_t>
constexpr int64_t kRowW2 = std::max<int64_t>(kRowW<scalar_t> / 2, 16 / sizeof(scalar_t));
template <typename scalar_t>
constexpr int64_t kRowW4 = std::max<int64_t>(kRowW<scalar_t> / 4, 16 / sizeof(scalar_t));
template <typename scalar_t>
constexpr int64_t row_width(int64_t n) {
  return n >= kRowW<scalar_t> ? kRowW<scalar_t>
                              : (n >= kRowW2<scalar_t> ? kRowW2<scalar_t> : kRowW4<scalar_t>);
}
template <typename scalar_t, typename F>
inline void by_width(int64_t n, F&& f) {
  const int64_t w = row_width<scalar_t>(n);
  if (w == kRowW<scalar_t>)
    f(std::integral_constant<int64_t, kRowW<scalar_t>>{});
  else if (w == kRowW2<scalar_t>)
    f(std::integral_constant<int64_t, kRowW2<scalar_t>>{});
  else
    f(std::integral_constant<int64_t, kRowW4<scalar_t>>{});
}

// A row's largest and second largest score (ties count twice) and its status:
// NaN or +inf anywhere, or every score -inf.
template <typename scalar_t, int64_t W>
inline int row_top2(const scalar_t* __restrict zr, int64_t n, scalar_t& m, scalar_t& m2) {
  using V = vec_t<scalar_t, W>;
  const int64_t full = n / W * W;
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  V va = V{} - inf, vb = va;
  auto vbad = va != va;
  for (int64_t i = 0; i < full; i += W) {
    const V v = vload<scalar_t, W>(zr + i);
    vbad |= (v != v) | (v == inf);  // NaN fails v == v
    const V lower = v < va ? v : va;
    vb = lower > vb ? lower : vb;
    va = v > va ? v : va;
  }
  htop2<scalar_t, W>(va, vb, m, m2);
  bool bad = false;
  for (int64_t k = 0; k < W; ++k) bad |= vbad[k] != 0;
  for (int64_t i = full; i < n; ++i) {
    const scalar_t v = zr[i];
    bad |= bad_value(v);
    const scalar_t lower = v < m ? v : m;
    m2 = lower > m2 ? lower : m2;
    m = v > m ? v : m;
  }
  if (bad) return kBadValue;
  if (m == -inf) return kAllMasked;
  return kOk;
}

// The start of the iteration: the threshold of the map restricted to the two
// largest scores (y_1 = 0 and y_2), moved down past its rounding. Dropping
// scores only lowers f, so any subset's threshold is a lower bound on tau;
// this one is tau itself (to the guard) on every row whose support has at most
// two experts, which then needs one pass. Rows with y_2 <= -1 (the runner-up
// zero by the threshold law) start at -1. On blocks of lanes (which take the
// passes of their slowest row), 1.5-entmax, whose supports are larger, also
// takes the threshold restricted to the three largest (y_3 too) where y_3 lies
// above it by more than the guard, so that all three are in that subset's
// support: a block of 16 rows of 16 experts takes 1.5 passes instead of 2.2.
template <typename scalar_t, Sparse M>
inline scalar_t top_start(scalar_t y2, scalar_t y3) {
  const scalar_t guard = 8 * std::numeric_limits<scalar_t>::epsilon();
  scalar_t t;
  if constexpr (M == Sparse::kSparsemax) {
    t = (y2 - scalar_t(1)) * scalar_t(0.5);  // (0 - t) + (y2 - t) = 1
  } else {
    const scalar_t s = scalar_t(2) - y2 * y2;  // t^2 + (y2 - t)^2 = 1, smaller root
    t = (y2 - std::sqrt(s > 0 ? s : scalar_t(0))) * scalar_t(0.5);
  }
  t -= guard;
  scalar_t lo = (y2 > scalar_t(-1) && t > scalar_t(-1)) ? t : scalar_t(-1);
  if constexpr (M == Sparse::kEntmax15) {
    // t^2 + (y2 - t)^2 + (y3 - t)^2 = 1, smaller root (y3 = -inf: NaN, not taken)
    const scalar_t s1 = y2 + y3, s2 = y2 * y2 + y3 * y3;
    const scalar_t disc = s1 * s1 - scalar_t(3) * (s2 - scalar_t(1));
    const scalar_t t3 = (s1 - std::sqrt(disc > 0 ? disc : scalar_t(0))) / scalar_t(3);
    lo = (disc >= scalar_t(0) && y3 > t3 + guard && t3 - guard > lo) ? t3 - guard : lo;
  } else {
    (void)y3;
  }
  return lo;
}

// From a pass's K, D1 and D2: the closed-form threshold on S (lo + step) and
// Newton's step on f from lo (lo + newton).
template <typename scalar_t, Sparse M>
inline void sparse_steps(scalar_t kf, scalar_t d1, scalar_t d2, scalar_t& step,
                         scalar_t& newton) {
  if constexpr (M == Sparse::kSparsemax) {
    step = (d1 - scalar_t(1)) / kf;
    newton = step;
  } else {
    const scalar_t e = d2 - scalar_t(1);
    newton = e / (scalar_t(2) * d1);
    const scalar_t disc = d1 * d1 - kf * e;
    // smaller root of sum_S (d - step)^2 = 1, in cancellation-free form
    step = disc >= scalar_t(0) ? e / (d1 + std::sqrt(disc > 0 ? disc : 0))
                               : std::numeric_limits<scalar_t>::infinity();
  }
}

// The outputs of one row from its scores, maximum, frame c and the threshold's
// offset from it: (y - c) - step clamped at 0 (the same y as in the passes, bit
// for bit).
template <typename scalar_t, Sparse M, int64_t W>
inline void sparse_output_row(const scalar_t* __restrict zr, scalar_t* __restrict pr, int64_t n,
                              scalar_t m, scalar_t c, scalar_t step) {
  using V = vec_t<scalar_t, W>;
  const int64_t full = n / W * W;
  const scalar_t half = (M == Sparse::kEntmax15) ? scalar_t(0.5) : scalar_t(1);
  const V vzero{};
  auto unit = [&](scalar_t y) {
    const scalar_t u = (y - c) - step;
    return u > scalar_t(0) ? u : scalar_t(0);
  };
  auto vunit = [&](V y) {
    const V u = (y - c) - step;
    return u > vzero ? u : vzero;
  };
  if constexpr (M == Sparse::kNormmax2) {
    V vt{};
    for (int64_t i0 = 0; i0 < full; i0 += kChunk * W) {  // (by chunks, as the passes)
      const int64_t i1 = std::min(full, i0 + kChunk * W);
      V ct{};
      for (int64_t i = i0; i < i1; i += W) {
        const V v = vunit((vload<scalar_t, W>(zr + i) - m) * half);
        vstore<scalar_t, W>(pr + i, v);
        ct += v;
      }
      vt += ct;
    }
    scalar_t total = hsum<scalar_t, W>(vt);
    for (int64_t i = full; i < n; ++i) {
      pr[i] = unit((zr[i] - m) * half);
      total += pr[i];
    }
    const scalar_t inv = scalar_t(1) / total;
    for (int64_t i = 0; i < full; i += W)
      vstore<scalar_t, W>(pr + i, vload<scalar_t, W>(pr + i) * inv);
    for (int64_t i = full; i < n; ++i) pr[i] *= inv;
  } else {
    for (int64_t i = 0; i < full; i += W) {
      const V v = vunit((vload<scalar_t, W>(zr + i) - m) * half);
      vstore<scalar_t, W>(pr + i, M == Sparse::kEntmax15 ? v * v : v);
    }
    for (int64_t i = full; i < n; ++i) {
      const scalar_t v = unit((zr[i] - m) * half);
      pr[i] = M == Sparse::kEntmax15 ? v * v : v;
    }
  }
}

// One row along the vector (see above); returns the row's status, and a row
// that is not ok gets zeros. y = (z - max) * half is recomputed from z in each
// pass, the same bits each time.
template <typename scalar_t, Sparse M, int64_t W>
inline int sparse_forward_row(const scalar_t* __restrict zr, scalar_t* __restrict pr,
                              int64_t n) {
  using V = vec_t<scalar_t, W>;
  const int64_t full = n / W * W;
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  const scalar_t half = (M == Sparse::kEntmax15) ? scalar_t(0.5) : scalar_t(1);
  const V vzero{};
  scalar_t m, m2;
  const int code = row_top2<scalar_t, W>(zr, n, m, m2);
  if (code != kOk) {
    for (int64_t i = 0; i < n; ++i) pr[i] = scalar_t(0);
    return code;
  }
  // NOTE: y = (z - max) first, then the halving, so that the runner-up's gap
  // is the one the caller computes and the threshold law is exact.
  // (the third largest score, for 1.5-entmax's start, is left out here: tracking it
  // cost a row as much as the passes it saved)
  scalar_t lo = top_start<scalar_t, M>((m2 - m) * half, -std::numeric_limits<scalar_t>::infinity());
  scalar_t c = lo, step = 0;  // the frame, and the threshold's offset from it
  int refines = 0;
  for (int64_t pass = 0; pass <= n + 1 + kMaxRefine; ++pass) {
    V vk{}, v1{}, v2{}, vmn = vzero + inf;
    // (rows of more than kChunk vectors sum by chunks, each from zero: a lane's
    // sum then rounds about kChunk + n / (kChunk W) times, not n / W; narrower
    // rows in one plain loop, written out twice: one loop for both measured
    // 3-4% slower for 1.5-entmax at 128-256 experts)
#define MOELAB_SPARSE_TERM(S1, S2)                                      \
  {                                                                     \
    const V y = (vload<scalar_t, W>(zr + i) - m) * half;                \
    const V d = y - c;                                                  \
    const auto in = y > lo;                                             \
    vk += in ? vzero + 1 : vzero;                                       \
    S1 += in ? d : vzero;                                               \
    if constexpr (M != Sparse::kSparsemax) S2 += in ? d * d : vzero;    \
    vmn = (in & (d < vmn)) ? d : vmn;                                   \
  }
    if (full <= kChunk * W) {
      for (int64_t i = 0; i < full; i += W) MOELAB_SPARSE_TERM(v1, v2)
    } else {
      for (int64_t i0 = 0; i0 < full; i0 += kChunk * W) {
        const int64_t i1 = std::min(full, i0 + kChunk * W);
        V c1{}, c2{};
        for (int64_t i = i0; i < i1; i += W) MOELAB_SPARSE_TERM(c1, c2)
        v1 += c1;
        if constexpr (M != Sparse::kSparsemax) v2 += c2;
      }
    }
#undef MOELAB_SPARSE_TERM
    scalar_t kf = hsum<scalar_t, W>(vk), d1 = hsum<scalar_t, W>(v1);
    scalar_t d2 = M != Sparse::kSparsemax ? hsum<scalar_t, W>(v2) : scalar_t(0);
    scalar_t mn = hmin<scalar_t, W>(vmn);
    for (int64_t i = full; i < n; ++i) {
      const scalar_t y = (zr[i] - m) * half;
      const scalar_t d = y - c;
      if (y > lo) {
        kf += 1;
        d1 += d;
        d2 += d * d;
        mn = d < mn ? d : mn;
      }
    }
    scalar_t newton;
    sparse_steps<scalar_t, M>(kf, d1, d2, step, newton);
    // S is the support (every member above the threshold), or this pass measured
    // a support already found, from a moved frame (c != lo)
    if (mn > step || c != lo) {
      // (no closed form, from a moved frame too far below tau: Newton's step on S)
      const bool real = std::abs(step) <= scalar_t(1);
      if (real && std::abs(step) * kf > scalar_t(kRefine) && refines < kMaxRefine) {
        c += step;
        ++refines;
        continue;
      }
      step = real ? step : newton;
      break;
    }
    const scalar_t next = lo + newton;
    if (!(next > lo)) break;  // the rounding floor
    lo = c = next;
  }
  sparse_output_row<scalar_t, M, W>(zr, pr, n, m, c, step);
  return kOk;
}

// One pass of the iteration over a block of lanes: for S = {y > lo}, per
// lane, K = |S|, D1 = sum_S (y - c), D2 = sum_S (y - c)^2, m = min_S (y - c).
// NOTE: kept out of line: inlined into the block loop, GCC 12 stops vectorising it.
template <typename scalar_t, Sparse M>
__attribute__((noinline)) void sparse_pass(const scalar_t* __restrict buf,
                                           const scalar_t* __restrict lo,
                                           const scalar_t* __restrict c,
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
      const scalar_t y = buf[j * L + l];
      const scalar_t d = y - c[l];
      const bool in = y > lo[l];
      kf[l] += in ? scalar_t(1) : scalar_t(0);
      d1[l] += in ? d : scalar_t(0);
      if constexpr (M != Sparse::kSparsemax) d2[l] += in ? d * d : scalar_t(0);
      mn[l] = (in && d < mn[l]) ? d : mn[l];
    }
  }
}

// One update of every lane of a block from its pass: a lane finishes once its
// candidate set is the support (after moving its frame c to the threshold while
// K |step| > kRefine, see "Precision") or Newton can no longer move lo. done is
// 0 or 1 per lane (a float, not a bool, so that the loop vectorises); returns how
// many lanes are still open.
// NOTE: kept out of line with restrict pointers, as sparse_pass, so that GCC
// vectorises it (inlined, it became a scalar loop with branches: a third of
// the forward's time).
template <typename scalar_t, Sparse M>
__attribute__((noinline)) int sparse_update(const scalar_t* __restrict kf,
                                            const scalar_t* __restrict d1,
                                            const scalar_t* __restrict d2,
                                            const scalar_t* __restrict mn,
                                            scalar_t* __restrict lo, scalar_t* __restrict c,
                                            scalar_t* __restrict fstep,
                                            scalar_t* __restrict done) {
  constexpr int64_t L = kLanes<scalar_t>;
  int open = 0;
#pragma omp simd reduction(+ : open)
  for (int64_t l = 0; l < L; ++l) {
    scalar_t step, newton;
    sparse_steps<scalar_t, M>(kf[l], d1[l], d2[l], step, newton);
    // the frame has moved (the support is known): c != lo
    const int32_t moved = c[l] != lo[l] ? 1 : 0;
    const int32_t exact = (mn[l] > step ? 1 : 0) | moved;
    // (no closed form, from a moved frame too far below tau: Newton's step on S)
    const scalar_t size = std::abs(step);
    const scalar_t st = size <= scalar_t(1) ? step : newton;
    const int32_t refine = exact & (size * kf[l] > scalar_t(kRefine) ? 1 : 0) &
                           (size <= scalar_t(1) ? 1 : 0);
    const scalar_t next = lo[l] + newton;
    const int32_t open_l = done[l] != scalar_t(0) ? 0 : 1;
    // another pass: Newton's step (lo and c move; not at the rounding floor) or a refinement
    const int32_t newt = open_l & (exact ^ 1) & (next > lo[l] ? 1 : 0);
    const int32_t ref = open_l & refine;
    const int32_t go = newt | ref;
    fstep[l] = (open_l & (go ^ 1)) != 0 ? st : fstep[l];
    c[l] = newt != 0 ? next : (ref != 0 ? c[l] + st : c[l]);
    lo[l] = newt != 0 ? next : lo[l];
    done[l] = go != 0 ? scalar_t(0) : scalar_t(1);
    open += go;
  }
  return open;
}

// Transposes of a block of kLanes rows into lanes and back, in L x L tiles
// with vector shuffles (element by element, the transposes were a quarter of
// the LapSum forward's time at n = 64 and most of the sparse maps' at n = 16).
template <typename scalar_t>
struct VecIO {
  typedef scalar_t unaligned
      __attribute__((vector_size(kVecBytes), aligned(sizeof(scalar_t)), may_alias));
  typedef std::conditional_t<sizeof(scalar_t) == 4, int32_t, int64_t> index
      __attribute__((vector_size(kVecBytes)));
};

// One stage of the transpose of a tile held as L row vectors, for the row pair
// (a, b) = (i, i + D), i without bit D: swaps bit D of the row index with bit D
// of the column index. After the stages D = 1, 2, .., L/2 the tile is transposed.
template <typename scalar_t, int64_t D, std::size_t... C>
__attribute__((always_inline)) inline void tile_swap_bit(vec_t<scalar_t, kLanes<scalar_t>>& a,
                                                         vec_t<scalar_t, kLanes<scalar_t>>& b,
                                                         std::index_sequence<C...>) {
  using V = vec_t<scalar_t, kLanes<scalar_t>>;
  constexpr int64_t L = kLanes<scalar_t>;
  constexpr int64_t c[] = {static_cast<int64_t>(C)...};
#if defined(__clang__)
  const V lo = __builtin_shufflevector(a, b, ((c[C] & D) ? L + (c[C] ^ D) : c[C])...);
  const V hi = __builtin_shufflevector(a, b, ((c[C] & D) ? L + c[C] : (c[C] ^ D))...);
#else
  using I = typename VecIO<scalar_t>::index;
  const V lo = __builtin_shuffle(a, b, I{((c[C] & D) ? L + (c[C] ^ D) : c[C])...});
  const V hi = __builtin_shuffle(a, b, I{((c[C] & D) ? L + c[C] : (c[C] ^ D))...});
#endif
  a = lo;
  b = hi;
}

template <typename scalar_t, int64_t D>
__attribute__((always_inline)) inline void tile_stage(vec_t<scalar_t, kLanes<scalar_t>>* v) {
  constexpr int64_t L = kLanes<scalar_t>;
  if constexpr (D < L) {
#pragma GCC unroll 16
    for (int64_t i = 0; i < L; ++i)
      if ((i & D) == 0) tile_swap_bit<scalar_t, D>(v[i], v[i + D], std::make_index_sequence<L>{});
    tile_stage<scalar_t, 2 * D>(v);
  }
}

// The transpose of the L x L tile with rows at src + i * ss (the first `rows`
// of them; the others read as zeros) into rows at dst + i * ds (the first
// `out` of them written).
// NOTE: the unrolled loads and stores keep GCC from turning them into memcpy calls.
template <typename scalar_t>
__attribute__((always_inline)) inline void transpose_tile(const scalar_t* src, int64_t ss,
                                                          int64_t rows, scalar_t* dst,
                                                          int64_t ds, int64_t out) {
  using V = vec_t<scalar_t, kLanes<scalar_t>>;
  using U = typename VecIO<scalar_t>::unaligned;
  constexpr int64_t L = kLanes<scalar_t>;
  V v[L];
#pragma GCC unroll 16
  for (int64_t i = 0; i < L; ++i) v[i] = i < rows ? *reinterpret_cast<const U*>(src + i * ss) : V{};
  tile_stage<scalar_t, 1>(v);
#pragma GCC unroll 16
  for (int64_t i = 0; i < L; ++i)
    if (i < out) *reinterpret_cast<U*>(dst + i * ds) = v[i];
}

// Rows [r0, r0 + nl) of z (rows of n entries) into buf[j * L + l]; padding
// lanes get zeros.
template <typename scalar_t>
__attribute__((noinline)) void transpose_in(const scalar_t* __restrict z, int64_t n, int64_t r0,
                                            int64_t nl, scalar_t* __restrict buf) {
  constexpr int64_t L = kLanes<scalar_t>;
  const scalar_t* zr = z + r0 * n;
  int64_t c = 0;
  for (; c + L <= n; c += L) transpose_tile<scalar_t>(zr + c, n, nl, buf + c * L, L, L);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j = c; j < n; ++j) buf[j * L + l] = l < nl ? zr[l * n + j] : scalar_t(0);
}

// The reverse: buf[j * L + l] into rows [r0, r0 + nl) of p.
template <typename scalar_t>
__attribute__((noinline)) void transpose_out(const scalar_t* __restrict buf, int64_t n,
                                             int64_t r0, int64_t nl, scalar_t* __restrict p) {
  constexpr int64_t L = kLanes<scalar_t>;
  scalar_t* pr = p + r0 * n;
  int64_t c = 0;
  for (; c + L <= n; c += L) transpose_tile<scalar_t>(buf + c * L, L, L, pr + c, n, nl);
  for (int64_t l = 0; l < nl; ++l)
    for (int64_t j = c; j < n; ++j) pr[l * n + j] = buf[j * L + l];
}

// Blocks of kLanes rows across the lanes of a vector: the block transposed
// into buf (n vectors of kLanes lanes), then every step, maximum and outputs
// included, one vector operation for all its rows. Rows the maps cannot take,
// and the padding lanes, hold zeros so that the shared iteration stays finite.
template <typename scalar_t, Sparse M>
void sparse_forward_lanes(const at::Tensor& z, at::Tensor& p, at::Tensor& status) {
  constexpr int64_t L = kLanes<scalar_t>;
  using V = vec_t<scalar_t, L>;
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
    scalar_t lo[L], fc[L], fstep[L], kf[L], d1[L], d2[L], mn[L], done[L];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * L, nl = std::min(L, rows - r0);
      transpose_in(zp, n, r0, nl, buf);
      // each lane's two largest scores (three for 1.5-entmax; ties count again)
      // and status
      V a = V{} - inf, b = a, c = a;
      auto bad = a != a;
      for (int64_t j = 0; j < n; ++j) {
        const V v = vload<scalar_t, L>(buf + j * L);
        bad |= (v != v) | (v == inf);  // NaN fails v == v
        const V lower = v < a ? v : a;
        if constexpr (M == Sparse::kEntmax15) {
          const V lower2 = lower < b ? lower : b;
          c = lower2 > c ? lower2 : c;
        }
        b = lower > b ? lower : b;
        a = v > a ? v : a;
      }
      const auto keep = ~bad & (a != -inf);
      for (int64_t l = 0; l < nl; ++l)
        st[r0 + l] = bad[l] ? kBadValue : (keep[l] ? kOk : kAllMasked);
      const V m = keep ? a : V{}, m2 = keep ? b : V{}, m3 = keep ? c : V{} - inf;
      // NOTE: y = (z - max) first, then the halving, so that the runner-up's
      // gap is the one the caller computes and the threshold law is exact.
      for (int64_t j = 0; j < n; ++j) {
        const V y = (vload<scalar_t, L>(buf + j * L) - m) * half;
        vstore<scalar_t, L>(buf + j * L, keep ? y : V{});
      }
      const V y2 = (m2 - m) * half, y3 = (m3 - m) * half;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) {
        lo[l] = fc[l] = top_start<scalar_t, M>(y2[l], y3[l]);
        fstep[l] = scalar_t(0);
        // (padding lanes and rows the map cannot take hold zeros: a flat row, which
        // would take refinement passes for nothing)
        done[l] = (l < nl && keep[l]) ? scalar_t(0) : scalar_t(1);
      }
      for (int64_t pass = 0; pass <= n + 1 + kMaxRefine; ++pass) {
        sparse_pass<scalar_t, M>(buf, lo, fc, kf, d1, d2, mn, n);
        if (sparse_update<scalar_t, M>(kf, d1, d2, mn, lo, fc, fstep, done) == 0) break;
      }
      // on S = {y > lo}: (y - c) - step, clamped at 0
      const V vc = vload<scalar_t, L>(fc);
      const V vs = vload<scalar_t, L>(fstep);
      V total{};
      for (int64_t j = 0; j < n; ++j) {
        const V y = vload<scalar_t, L>(buf + j * L);
        const V u = (y - vc) - vs;
        V v = u > V{} ? u : V{};
        if constexpr (M == Sparse::kEntmax15) v = v * v;
        if constexpr (M == Sparse::kNormmax2) total += v;
        vstore<scalar_t, L>(buf + j * L, keep ? v : V{});
      }
      if constexpr (M == Sparse::kNormmax2) {
        const V inv = scalar_t(1) / total;
        for (int64_t j = 0; j < n; ++j)
          vstore<scalar_t, L>(buf + j * L, vload<scalar_t, L>(buf + j * L) * inv);
      }
      transpose_out(buf, n, r0, nl, pp);
    }
  });
}

// Whether the forward kernel of a sparse map takes rows of n entries by blocks
// of kLanes rows (else along the row). Measured (float32, 16384 rows, one
// thread, forward and backward), with AVX-512: along the row from 64 experts
// for sparsemax, from 128 for the others; with AVX2 from 64 for all three (at
// 96-128 experts the row took 0.4-0.8x the blocks' time for 1.5-entmax and
// 2-normmax, and about the same at 64); by lanes below. Narrower vectors (SSE2,
// NEON) take AVX2's crossover, unmeasured.
template <typename scalar_t, Sparse M>
constexpr bool sparse_by_lanes(int64_t n) {
  constexpr int64_t W = 64 / sizeof(scalar_t);  // (entries of 64 bytes)
  return n < (M != Sparse::kSparsemax && kVecBytes == 64 ? 8 * W : 4 * W);
}

template <typename scalar_t, Sparse M>
void sparse_forward_impl(const at::Tensor& z, at::Tensor& p, at::Tensor& status) {
  constexpr int64_t W = kRowW<scalar_t>;
  const int64_t rows = z.size(0), n = z.size(1);
  if (sparse_by_lanes<scalar_t, M>(n)) {
    sparse_forward_lanes<scalar_t, M>(z, p, status);
    return;
  }
  const scalar_t* zp = z.const_data_ptr<scalar_t>();
  scalar_t* pp = p.mutable_data_ptr<scalar_t>();
  int32_t* st = status.mutable_data_ptr<int32_t>();
  // (rows this wide fill whole vectors)
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      st[r] = sparse_forward_row<scalar_t, M, W>(zp + r * n, pp + r * n, n);
  });
}

// J^T g of one row of a sparse map from its output p, the first `full`
// entries (a multiple of W) in vectors of W lanes, the rest one by one.
template <typename scalar_t, Sparse M, int64_t W>
inline void sparse_backward_row(const scalar_t* __restrict pr, const scalar_t* __restrict gr,
                                scalar_t* __restrict dr, int64_t n) {
  using V = vec_t<scalar_t, W>;
  const int64_t full = n / W * W;
  const V vzero{};
  const scalar_t zero(0);
  if constexpr (M == Sparse::kSparsemax) {
    // J = diag(s) - s s^T / |S|,  s = 1[p > 0]
    V vg{}, vc{};
    for (int64_t i = 0; i < full; i += W) {
      const V p = vload<scalar_t, W>(pr + i), g = vload<scalar_t, W>(gr + i);
      const auto in = p > vzero;
      vg += in ? g : vzero;
      vc += in ? vzero + 1 : vzero;
    }
    scalar_t gsum = hsum<scalar_t, W>(vg), count = hsum<scalar_t, W>(vc);
    for (int64_t i = full; i < n; ++i) {
      const bool in = pr[i] > zero;
      gsum += in ? gr[i] : zero;
      count += in ? scalar_t(1) : zero;
    }
    const scalar_t mean = gsum / count;
    for (int64_t i = 0; i < full; i += W) {
      const V p = vload<scalar_t, W>(pr + i), g = vload<scalar_t, W>(gr + i);
      vstore<scalar_t, W>(dr + i, p > vzero ? g - mean : vzero);
    }
    for (int64_t i = full; i < n; ++i) dr[i] = pr[i] > zero ? gr[i] - mean : zero;
  } else if constexpr (M == Sparse::kEntmax15) {
    // J = diag(s) - s s^T / sum(s),  s = p^(2 - alpha) = sqrt(p)
    V vs{}, vsg{};
    for (int64_t i = 0; i < full; i += W) {
      V s = vload<scalar_t, W>(pr + i);
      for (int64_t k = 0; k < W; ++k) s[k] = std::sqrt(s[k]);
      vs += s;
      vsg += s * vload<scalar_t, W>(gr + i);
    }
    scalar_t ssum = hsum<scalar_t, W>(vs), sg = hsum<scalar_t, W>(vsg);
    for (int64_t i = full; i < n; ++i) {
      const scalar_t s = std::sqrt(pr[i]);
      ssum += s;
      sg += s * gr[i];
    }
    const scalar_t q = sg / ssum;
    for (int64_t i = 0; i < full; i += W) {
      V s = vload<scalar_t, W>(pr + i);
      for (int64_t k = 0; k < W; ++k) s[k] = std::sqrt(s[k]);
      vstore<scalar_t, W>(dr + i, s * (vload<scalar_t, W>(gr + i) - q));
    }
    for (int64_t i = full; i < n; ++i) dr[i] = std::sqrt(pr[i]) * (gr[i] - q);
  } else {
    // 2-normmax: p = u / S, u = (z - tau)_+, sum u^2 = 1, hence 1/S = ||p||_2.
    //   h = (g - <g, p>) / S,   dz = h 1[p > 0] - (sum_{p > 0} h) p
    V vpp{}, vgp{}, vgs{}, vc{};
    for (int64_t i = 0; i < full; i += W) {
      const V p = vload<scalar_t, W>(pr + i), g = vload<scalar_t, W>(gr + i);
      const auto in = p > vzero;
      vpp += p * p;
      vgp += p * g;
      vgs += in ? g : vzero;
      vc += in ? vzero + 1 : vzero;
    }
    scalar_t pp2 = hsum<scalar_t, W>(vpp), gpd = hsum<scalar_t, W>(vgp);
    scalar_t gs = hsum<scalar_t, W>(vgs), cnt = hsum<scalar_t, W>(vc);
    for (int64_t i = full; i < n; ++i) {
      const scalar_t pi = pr[i];
      const bool in = pi > zero;
      pp2 += pi * pi;
      gpd += pi * gr[i];
      gs += in ? gr[i] : zero;
      cnt += in ? scalar_t(1) : zero;
    }
    const scalar_t inv_s = std::sqrt(pp2);
    const scalar_t hsum_ = (gs - cnt * gpd) * inv_s;
    for (int64_t i = 0; i < full; i += W) {
      const V p = vload<scalar_t, W>(pr + i), g = vload<scalar_t, W>(gr + i);
      vstore<scalar_t, W>(dr + i, p > vzero ? (g - gpd) * inv_s - hsum_ * p : vzero);
    }
    for (int64_t i = full; i < n; ++i) {
      const scalar_t pi = pr[i];
      dr[i] = pi > zero ? (gr[i] - gpd) * inv_s - hsum_ * pi : zero;
    }
  }
}

template <typename scalar_t, Sparse M>
void sparse_backward_impl(const at::Tensor& p, const at::Tensor& g, at::Tensor& dz) {
  const int64_t rows = p.size(0), n = p.size(1);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = g.const_data_ptr<scalar_t>();
  scalar_t* dp = dz.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    by_width<scalar_t>(n, [&](auto W) {
      for (int64_t r = begin; r < end; ++r)
        sparse_backward_row<scalar_t, M, W>(pp + r * n, gp + r * n, dp + r * n, n);
    });
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
// longer changes (at most n + 1 rounds; 2-4 in practice).
// NOTE: x is never formed as one float: when t is below the float spacing of
// the scores (t = 2e-6 at z = 100 in float32, or scores 1e30 apart), c + t log u
// rounds back to c. The threshold is carried as x = ref + t s, with ref a score
// next to the split and s in units of t (double), and outputs use the exact
// differences (z - ref)/t - s.

__attribute__((always_inline)) inline double log_pos(double u);  // (with the general-alpha maps)

inline double log_add_exp(double x, double y) {
  const double m = x > y ? x : y;
  if (m == -std::numeric_limits<double>::infinity()) return m;
  return m + std::log1p(std::exp(-std::abs(x - y)));
}

// The root of one split's equation. With lo the largest score below the split,
// hi the smallest above it, a = sum_below exp((z - lo)/t), b = sum_above
// exp((hi - z)/t), gap = (hi - lo)/t and dk = k - n_above, the equation
//     a/2 e^{-v} + n_above - b/2 e^{v - gap} = k,   v = (x - lo)/t,
// has, with 4AB = a b e^{-gap} and L = log(|dk| + sqrt(dk^2 + 4AB)),
//     dk >= 0:  x = lo + t (log a - L),    dk < 0:  x = hi + t (L - log b).
// Sets from_lo and returns s (finite: dk = 0 across an overflowing gap has
// every point of the gap as a root).
inline double lapsum_split_root(double kk, double above, double a, double b, double gap,
                                bool& from_lo) {
  const double dk = kk - above;
  const double log_a = std::log(a), log_b = std::log(b);  // -inf for an empty group
  const double log_ad = std::log(std::abs(dk));
  const double log_root = 0.5 * log_add_exp(2.0 * log_ad, log_a + log_b - gap);
  const double log_sum = log_add_exp(log_ad, log_root);
  from_lo = dk >= 0.0;
  double s = from_lo ? log_a - log_sum : log_sum - log_b;
  if (std::isnan(s)) s = 0.0;
  return std::min(std::max(s, -1e300), 1e300);
}

// The same round without exponentials. With e_i = exp((z_i - max)/t), computed
// once, and the split point carried as C = exp((max - c)/t): z_i > c iff
// e_i > 1/C, and q_i = e_i C below the split, 1/(e_i C) above it. One pass
// gives, per lane, n_above, a = sum_below q and b = sum_above q.
template <typename scalar_t>
__attribute__((noinline)) void lapsum_pass_scaled(
    const scalar_t* __restrict eb, const scalar_t* __restrict rb,
    const scalar_t* __restrict scale, const scalar_t* __restrict inv_scale,
    scalar_t* __restrict a, scalar_t* __restrict b, scalar_t* __restrict above, int64_t n) {
  using V = vec_t<scalar_t, kLanes<scalar_t>>;
  using U = typename VecIO<scalar_t>::unaligned;
  constexpr int64_t L = kLanes<scalar_t>;
  const V sc = *reinterpret_cast<const U*>(scale), is = *reinterpret_cast<const U*>(inv_scale);
  const V zero = V{}, one = zero + scalar_t(1);
  // NOTE: two sets of sums (even and odd j), in vector registers: one set is
  // bound by the latency of its additions
  V a0 = zero, b0 = zero, n0 = zero, a1 = zero, b1 = zero, n1 = zero;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const V e0 = *reinterpret_cast<const U*>(eb + j * L);
    const V r0 = *reinterpret_cast<const U*>(rb + j * L);  // rb = 1/e
    const V e1 = *reinterpret_cast<const U*>(eb + (j + 1) * L);
    const V r1 = *reinterpret_cast<const U*>(rb + (j + 1) * L);
    const auto up0 = e0 > is, up1 = e1 > is;
    n0 += up0 ? one : zero;
    a0 += up0 ? zero : e0 * sc;
    b0 += up0 ? is * r0 : zero;
    n1 += up1 ? one : zero;
    a1 += up1 ? zero : e1 * sc;
    b1 += up1 ? is * r1 : zero;
  }
  if (j < n) {
    const V e0 = *reinterpret_cast<const U*>(eb + j * L);
    const V r0 = *reinterpret_cast<const U*>(rb + j * L);
    const auto up0 = e0 > is;
    n0 += up0 ? one : zero;
    a0 += up0 ? zero : e0 * sc;
    b0 += up0 ? is * r0 : zero;
  }
  *reinterpret_cast<U*>(a) = a0 + a1;
  *reinterpret_cast<U*>(b) = b0 + b1;
  *reinterpret_cast<U*>(above) = n0 + n1;
}

// One e-space round's update, per lane: the root u = e^{(x - c)/t} of
// A/u + n_above - B u = k (A = a/2, B = b/2, stably for each sign of
// dk = k - n_above) moves C to C/u. A lane is done once its split repeats (the
// exact root) or C no longer moves (converged to rounding); done lanes keep C.
// Returns whether every lane is done; `overflow` is set when a C reaches `big`
// (or falls to 1/big).
// NOTE: written so that GCC 12 vectorises it: int32 flags combined with | (bool
// flags, || or a select between bools keep it scalar), every branch of u
// computed and selected, out of line with restrict pointers.
template <typename scalar_t>
__attribute__((noinline)) bool lapsum_update_scaled(
    const scalar_t* __restrict a, const scalar_t* __restrict b, const scalar_t* __restrict above,
    const scalar_t* __restrict kl, scalar_t* __restrict prev, scalar_t* __restrict scale,
    scalar_t* __restrict inv_scale, int32_t* __restrict done, scalar_t big, bool& overflow) {
  constexpr int64_t L = kLanes<scalar_t>;
  int32_t over[L];
#pragma omp simd
  for (int64_t l = 0; l < L; ++l) {
    const int32_t fin = done[l] | (above[l] == prev[l] ? 1 : 0);  // split unchanged: exact
    prev[l] = above[l];
    const scalar_t A = scalar_t(0.5) * a[l], B = scalar_t(0.5) * b[l];
    const scalar_t dk = kl[l] - above[l];
    // root = sqrt(dk^2 + 4AB), and |dk| itself where AB = 0 (no group above: a
    // tiny k): dk^2 underflows for k < 1e-19 in float32 (1e-154 in float64), and
    // the root of 0 halved u (the outputs summed to k/2)
    const scalar_t ab4 = scalar_t(4) * A * B;
    const scalar_t root = ab4 > scalar_t(0) ? std::sqrt(dk * dk + ab4) : std::abs(dk);
    const scalar_t u_pos = scalar_t(2) * A / (dk + root);
    const scalar_t u_neg = (root - dk) / (scalar_t(2) * B);
    const scalar_t u_zero = std::sqrt(A / B);
    const scalar_t u = dk > scalar_t(0) ? u_pos : (dk < scalar_t(0) ? u_neg : u_zero);
    const scalar_t sc = scale[l], is = inv_scale[l];
    const scalar_t next = fin != 0 ? sc : sc / u;
    // (C leaves the range: a tiny k puts x far above the maximum, C = e^{(max - x)/t}
    // underflows, and the outputs with it; the log-domain rounds take those rows)
    over[l] = ((next < big ? 1 : 0) & (next * big > scalar_t(1) ? 1 : 0)) ^ 1;
    const int32_t same = next == sc ? 1 : 0;  // converged to rounding
    inv_scale[l] = fin != 0 ? is : is * u;
    scale[l] = next;
    done[l] = fin | same;
  }
  int32_t all = 1, any = 0;
  for (int64_t l = 0; l < L; ++l) {
    all &= done[l];
    any |= over[l];
  }
  overflow = any != 0;
  return all != 0;
}

// The outputs at the final split of the e-space rounds: p = F(y) from
// q = e^{-|y|} (q_i as in lapsum_pass_scaled), into qb, with per lane sum p and
// sum F' (F' = min(p, 1 - p) = q/2). Rows with an error (ok = 0) get 0.
template <typename scalar_t>
__attribute__((always_inline)) inline void lapsum_out_step(
    const scalar_t* __restrict eb, const scalar_t* __restrict rb, scalar_t* __restrict qb,
    vec_t<scalar_t, kLanes<scalar_t>> sc, vec_t<scalar_t, kLanes<scalar_t>> is,
    vec_t<scalar_t, kLanes<scalar_t>> ok, vec_t<scalar_t, kLanes<scalar_t>>& total,
    vec_t<scalar_t, kLanes<scalar_t>>& fsum) {
  using V = vec_t<scalar_t, kLanes<scalar_t>>;
  using U = typename VecIO<scalar_t>::unaligned;
  const V e = *reinterpret_cast<const U*>(eb);
  const V r = *reinterpret_cast<const U*>(rb);
  const auto up = e > is;
  const V q = scalar_t(0.5) * (up ? is * r : e * sc);
  const V v = (up ? scalar_t(1) - q : q) * ok;
  *reinterpret_cast<U*>(qb) = v;
  total += v;
  fsum += q;
}

template <typename scalar_t>
__attribute__((noinline)) void lapsum_out_scaled(
    const scalar_t* __restrict eb, const scalar_t* __restrict rb,
    const scalar_t* __restrict scale, const scalar_t* __restrict inv_scale,
    const scalar_t* __restrict ok, scalar_t* __restrict qb, scalar_t* __restrict total,
    scalar_t* __restrict fsum, int64_t n) {
  using V = vec_t<scalar_t, kLanes<scalar_t>>;
  using U = typename VecIO<scalar_t>::unaligned;
  constexpr int64_t L = kLanes<scalar_t>;
  const V sc = *reinterpret_cast<const U*>(scale), is = *reinterpret_cast<const U*>(inv_scale);
  const V okv = *reinterpret_cast<const U*>(ok);
  V t0 = V{}, f0 = V{}, t1 = V{}, f1 = V{};  // two sets of sums, as lapsum_pass_scaled
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    lapsum_out_step<scalar_t>(eb + j * L, rb + j * L, qb + j * L, sc, is, okv, t0, f0);
    lapsum_out_step<scalar_t>(eb + (j + 1) * L, rb + (j + 1) * L, qb + (j + 1) * L, sc, is, okv,
                              t1, f1);
  }
  if (j < n) lapsum_out_step<scalar_t>(eb + j * L, rb + j * L, qb + j * L, sc, is, okv, t0, f0);
  *reinterpret_cast<U*>(total) = t0 + t1;
  *reinterpret_cast<U*>(fsum) = f0 + f1;
}

// exp(x) for x <= 0 down into the subnormal range of T (exp_nonpos stops at the
// smallest normal number): for the outputs of the log-domain rounds, which a
// subnormal k (in float64) makes subnormal. 2^-64 e^{x + 64 ln 2} below the
// normal range (ln 2 * 64 is rounded: about 1e-15 relative, and a subnormal
// result is rounded more coarsely than that).
template <typename T>
__attribute__((always_inline)) inline T exp_nonpos_sub(T x) {
  if constexpr (std::is_same<T, double>::value) {
    const bool low = !(x > -708.0);
    const double v = exp_nonpos<double>(low ? x + 44.3614195558365 : x);
    return low ? v * 5.421010862427522e-20 : v;  // 2^-64
  } else {
    return exp_nonpos<T>(x);
  }
}

// y = (z - ref)/t - s in acc_t; d = 0 stays 0 when 1/t is still infinite
// (t subnormal in double).
template <typename acc_t, typename scalar_t>
__attribute__((always_inline)) inline acc_t lapsum_y(scalar_t v, scalar_t ref, acc_t inv,
                                                     acc_t s) {
  const acc_t d = static_cast<acc_t>(v) - static_cast<acc_t>(ref);
  return (d == acc_t(0) ? acc_t(0) : d * inv) - s;
}

// The passes of the rounds measured from the scores next to the split, per lane.
// NOTE: kept out of line with restrict pointers, as sparse_pass, so that GCC
// vectorises them.
// Split at x = ref + t s: size of the group above, nearest scores below and above.
template <typename scalar_t, typename acc_t>
__attribute__((noinline)) void lapsum_split_pass(
    const scalar_t* __restrict zb, const scalar_t* __restrict ref, const acc_t* __restrict s,
    const acc_t* __restrict inv, scalar_t* __restrict above, scalar_t* __restrict lo_max,
    scalar_t* __restrict hi_min, int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  for (int64_t l = 0; l < L; ++l) {
    above[l] = scalar_t(0);
    lo_max[l] = -inf;
    hi_min[l] = inf;
  }
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t v = zb[j * L + l];
      const bool up = lapsum_y<acc_t>(v, ref[l], inv[l], s[l]) > acc_t(0);
      above[l] += up ? scalar_t(1) : scalar_t(0);
      lo_max[l] = (!up && v > lo_max[l]) ? v : lo_max[l];
      hi_min[l] = (up && v < hi_min[l]) ? v : hi_min[l];
    }
  }
}

// a = sum_below exp((z - lo)/t) >= 1, b = sum_above exp((hi - z)/t) >= 1.
template <typename scalar_t, typename acc_t>
__attribute__((noinline)) void lapsum_sum_pass(
    const scalar_t* __restrict zb, const scalar_t* __restrict ref, const acc_t* __restrict s,
    const acc_t* __restrict inv, const scalar_t* __restrict lo_max,
    const scalar_t* __restrict hi_min, acc_t* __restrict a, acc_t* __restrict b, int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < L; ++l) a[l] = b[l] = acc_t(0);
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t v = zb[j * L + l];
      const bool up = lapsum_y<acc_t>(v, ref[l], inv[l], s[l]) > acc_t(0);
      const acc_t d = up ? static_cast<acc_t>(hi_min[l]) - static_cast<acc_t>(v)
                         : static_cast<acc_t>(v) - static_cast<acc_t>(lo_max[l]);
      // NaN (masked score, nothing finite below) and -inf give 0
      const acc_t e = exp_nonpos<acc_t>(d == acc_t(0) ? acc_t(0) : d * inv[l]);
      a[l] += up ? acc_t(0) : e;
      b[l] += up ? e : acc_t(0);
    }
  }
}

// p = F(y - dl) into qb where `only` is unset or dl != 0, with sum p and sum F'.
template <typename scalar_t, typename acc_t>
__attribute__((noinline)) void lapsum_out_pass(
    const scalar_t* __restrict zb, const scalar_t* __restrict ref, const acc_t* __restrict s,
    const acc_t* __restrict inv, const acc_t* __restrict dl, const scalar_t* __restrict ok,
    scalar_t* __restrict qb, scalar_t* __restrict total, scalar_t* __restrict fsum, bool only,
    int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  for (int64_t l = 0; l < L; ++l) total[l] = fsum[l] = scalar_t(0);
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const acc_t y = lapsum_y<acc_t>(zb[j * L + l], ref[l], inv[l], s[l]) - dl[l];
      const scalar_t q = static_cast<scalar_t>(acc_t(0.5) * exp_nonpos_sub<acc_t>(-std::abs(y)));
      const scalar_t v = (y > acc_t(0) ? scalar_t(1) - q : q) * ok[l];
      const bool keep = only && dl[l] == acc_t(0);
      qb[j * L + l] = keep ? qb[j * L + l] : v;
      total[l] += v;
      fsum[l] += q;
    }
  }
}

// NOTE: s is rounded; one Newton step on it (d sum p / ds = -sum F') takes the
// last rounding off the sum: the rows whose sum of p misses k by more than
// 16 eps max(k, 1) get their outputs again at s + dl, dl = (sum p - k) / sum F'
// (dl and delta: 0 elsewhere).
template <typename scalar_t, typename acc_t>
void lapsum_newton_fix(const scalar_t* zb, const scalar_t* ref, const acc_t* s, const acc_t* inv,
                       const scalar_t* ok, const scalar_t* kl, const int32_t* code, int64_t nl,
                       scalar_t* qb, scalar_t* total, scalar_t* fsum, acc_t* dl, double* delta,
                       int64_t n) {
  constexpr int64_t L = kLanes<scalar_t>;
  int32_t fix = 0;
#pragma omp simd reduction(| : fix)
  for (int64_t l = 0; l < L; ++l) {
    const scalar_t kk = kl[l];
    const scalar_t resid = total[l] - kk;
    const scalar_t tol = scalar_t(16) * std::numeric_limits<scalar_t>::epsilon() *
                         (kk > scalar_t(1) ? kk : scalar_t(1));
    const bool need = l < nl && code[l] == kOk && std::abs(resid) > tol && fsum[l] > scalar_t(0);
    dl[l] = need ? static_cast<acc_t>(resid) / static_cast<acc_t>(fsum[l]) : acc_t(0);
    delta[l] = static_cast<double>(dl[l]);
    fix |= need ? 1 : 0;
  }
  if (fix) lapsum_out_pass<scalar_t, acc_t>(zb, ref, s, inv, dl, ok, qb, total, fsum, true, n);
}

// The rest of a LapSum block when the e-space rounds gave up: the rounds
// measured from the scores next to the split, the outputs p = F(y), and a
// Newton step on s. acc_t is the type y is computed in: scalar_t, or double
// when 1/t overflows scalar_t.
template <typename scalar_t, typename acc_t>
void lapsum_finish(const scalar_t* zb, scalar_t* qb, int64_t n, int64_t nl, const int32_t* code,
                   const scalar_t* kl, const scalar_t* mx, const double* td, scalar_t* ref_out,
                   acc_t* s_out, double* delta) {
  constexpr int64_t L = kLanes<scalar_t>;
  scalar_t ref[L], above[L], prev[L], lo_max[L], hi_min[L], total[L], fsum[L], ok[L];
  acc_t s[L], inv[L], a[L], b[L], dl[L];
  bool done[L];
  for (int64_t l = 0; l < L; ++l) {
    inv[l] = acc_t(1) / static_cast<acc_t>(td[l]);
    ref[l] = code[l] == kOk ? mx[l] : scalar_t(0);
    s[l] = acc_t(0);
    prev[l] = scalar_t(-1);
    done[l] = code[l] != kOk || l >= nl;
    dl[l] = acc_t(0);
    delta[l] = 0.0;
    ok[l] = code[l] == kOk ? scalar_t(1) : scalar_t(0);  // rows with an error get 0
  }
  for (int64_t round = 0; round <= n + 1; ++round) {
    lapsum_split_pass<scalar_t, acc_t>(zb, ref, s, inv, above, lo_max, hi_min, n);
    bool all_done = true;
    for (int64_t l = 0; l < L; ++l) {
      if (!done[l] && above[l] == prev[l]) done[l] = true;  // split unchanged: exact root
      prev[l] = above[l];
      all_done = all_done && done[l];
    }
    if (all_done) break;
    lapsum_sum_pass<scalar_t, acc_t>(zb, ref, s, inv, lo_max, hi_min, a, b, n);
    for (int64_t l = 0; l < L; ++l) {
      if (done[l]) continue;
      const double gap = (static_cast<double>(hi_min[l]) - static_cast<double>(lo_max[l])) *
                         static_cast<double>(inv[l]);
      bool from_lo = true;
      const double root =
          lapsum_split_root(static_cast<double>(kl[l]), static_cast<double>(above[l]),
                            static_cast<double>(a[l]), static_cast<double>(b[l]), gap, from_lo);
      // finite in acc_t too (inf - inf would make NaN)
      const double big = static_cast<double>(std::numeric_limits<acc_t>::max());
      s[l] = static_cast<acc_t>(std::min(std::max(root, -big), big));
      ref[l] = from_lo ? lo_max[l] : hi_min[l];
    }
  }
  // p_i = F(y_i)
  lapsum_out_pass<scalar_t, acc_t>(zb, ref, s, inv, dl, ok, qb, total, fsum, false, n);
  lapsum_newton_fix<scalar_t, acc_t>(zb, ref, s, inv, ok, kl, code, nl, qb, total, fsum, dl, delta,
                                     n);
  for (int64_t l = 0; l < L; ++l) {
    ref_out[l] = ref[l];
    s_out[l] = s[l];
  }
}

// Per-lane maximum, number of finite scores, k and status of a block (with
// the k check: k must lie in (0, #finite), counted before bad
// rows are zeroed). Rows the map cannot take are replaced by zeros, with max 0.
template <typename scalar_t>
inline void lapsum_block_stats(scalar_t* buf, int64_t n, int64_t nl, const scalar_t* kl,
                               scalar_t* mx, int32_t* code) {
  constexpr int64_t L = kLanes<scalar_t>;
  const scalar_t inf = std::numeric_limits<scalar_t>::infinity();
  int32_t bad[L];
  scalar_t finite[L];
  for (int64_t l = 0; l < L; ++l) {
    mx[l] = -inf;
    bad[l] = 0;
    finite[l] = scalar_t(0);
  }
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t v = buf[j * L + l];
      bad[l] |= bad_value(v) ? 1 : 0;
      mx[l] = v > mx[l] ? v : mx[l];
      finite[l] += v > -inf ? scalar_t(1) : scalar_t(0);
    }
  }
  int32_t any_bad = 0;
#pragma omp simd reduction(| : any_bad)
  for (int64_t l = 0; l < L; ++l) {
    const bool bad_k = l < nl && !(kl[l] > scalar_t(0) && kl[l] < finite[l]);
    code[l] = bad[l] ? kBadValue : (mx[l] == -inf ? kAllMasked : (bad_k ? kBadK : kOk));
    any_bad |= code[l] != kOk ? 1 : 0;
  }
  if (any_bad) {
    for (int64_t l = 0; l < L; ++l) {
      if (code[l] == kOk) continue;
      for (int64_t j = 0; j < n; ++j) buf[j * L + l] = scalar_t(0);
      mx[l] = scalar_t(0);
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
  // Typical rows: rounds in e-space, e = exp((z - max)/t) <= 1 computed once,
  // the split carried as C = exp((max - c)/t). The root of a split's quadratic
  // is then a ratio u = exp((x - c)/t) and moves C to C/u: no exponential or
  // logarithm per round.
  // NOTE: exact only while no finite e underflows and C stays finite, so
  // rows spread over more than `reach` temperatures (or whose x runs that
  // far below the maximum) take the log-domain rounds (lapsum_finish) instead.
  const scalar_t reach = static_cast<scalar_t>(
      std::log(static_cast<double>(std::numeric_limits<scalar_t>::max())) - 8.0);
  const scalar_t big = std::exp(reach);
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> zs(n * L), qs(n * L), es(n * L), rs(n * L);
    scalar_t* zb = zs.data();
    scalar_t* qb = qs.data();
    scalar_t* eb = es.data();
    scalar_t* rb = rs.data();
    scalar_t mx[L], inv_t[L], a[L], b[L], above[L], prev[L], ref[L], kl[L], lowest[L];
    scalar_t scale[L], inv_scale[L], ok[L], total[L], fsum[L], dl[L];
    double td[L], sd[L], delta[L];
    int32_t code[L], done[L];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * L, nl = std::min(L, rows - r0);
      transpose_in(zp, n, r0, nl, zb);
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) kl[l] = l < nl ? kp[r0 + l] : scalar_t(1);
      lapsum_block_stats(zb, n, nl, kl, mx, code);
      // some row's 1/t overflows scalar_t, or its k is so small that its outputs
      // (each at most k) fall below scalar_t's normal range, where exp_nonpos<float>
      // gives 0: those blocks take the log-domain rounds in double
      const scalar_t tiny_k = std::numeric_limits<scalar_t>::min() * scalar_t(1 << 20);
      int32_t wide = 0;
#pragma omp simd reduction(| : wide)
      for (int64_t l = 0; l < L; ++l) {
        const scalar_t tt = l < nl ? tp[r0 + l] : scalar_t(1);
        inv_t[l] = scalar_t(1) / tt;
        td[l] = static_cast<double>(tt);
        prev[l] = scalar_t(-1);
        done[l] = code[l] != kOk || l >= nl ? 1 : 0;
        ok[l] = code[l] == kOk ? scalar_t(1) : scalar_t(0);  // rows with an error get 0
        ref[l] = code[l] == kOk ? mx[l] : scalar_t(0);
        lowest[l] = a[l] = b[l] = above[l] = scalar_t(0);
        scale[l] = inv_scale[l] = scalar_t(1);
        wide |= (l < nl && code[l] == kOk && (!(inv_t[l] < inf) || kl[l] < tiny_k)) ? 1 : 0;
      }
      for (int64_t l = 0; l < nl; ++l) st[r0 + l] = code[l];
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
      int32_t far = 0;  // (an infinite 1/t, t subnormal, takes the rounds below)
#pragma omp simd reduction(| : far)
      for (int64_t l = 0; l < L; ++l)
        far |= (done[l] == 0) & !((-lowest[l] < reach) & (inv_t[l] < inf)) ? 1 : 0;
      bool scaled = far == 0 && wide == 0;
      for (int64_t round = 0; scaled && round <= n + 1; ++round) {
        if (round > 0) lapsum_pass_scaled<scalar_t>(eb, rb, scale, inv_scale, a, b, above, n);
        bool overflow = false;
        const bool all_done = lapsum_update_scaled<scalar_t>(a, b, above, kl, prev, scale,
                                                             inv_scale, done, big, overflow);
        if (overflow) scaled = false;
        if (all_done) break;
      }
      if (scaled) {
        // p_i = F(y_i) at the final split; the threshold is x = max + t s with
        // s = log(1/C).
        lapsum_out_scaled<scalar_t>(eb, rb, scale, inv_scale, ok, qb, total, fsum, n);
        // (inv_scale lies in [1/big, big], normal: log_pos's domain; its loop
        // vectorises where std::log's, a call per row, took 5% of the forward)
        scalar_t s[L];
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const bool use = l < nl && code[l] == kOk;
          s[l] = use ? static_cast<scalar_t>(log_pos(static_cast<double>(inv_scale[l])))
                     : scalar_t(0);
          sd[l] = static_cast<double>(s[l]);
        }
        lapsum_newton_fix<scalar_t, scalar_t>(zb, ref, s, inv_t, ok, kl, code, nl, qb, total, fsum,
                                              dl, delta, n);
      } else if (std::is_same<scalar_t, double>::value || wide) {
        // The threshold as x = ref + t s (ref a score, s in units of t); the rest
        // of the block in scalar_t, or in double where 1/t overflows scalar_t or k
        // is tiny.
        double s[L];
        lapsum_finish<scalar_t, double>(zb, qb, n, nl, code, kl, mx, td, ref, s, delta);
        for (int64_t l = 0; l < L; ++l) sd[l] = s[l];
      } else {
        scalar_t s[L];
        lapsum_finish<scalar_t, scalar_t>(zb, qb, n, nl, code, kl, mx, td, ref, s, delta);
        for (int64_t l = 0; l < L; ++l) sd[l] = static_cast<double>(s[l]);
      }
      transpose_out(qb, n, r0, nl, pp);
      // x itself, rounded (informational: the gradients need only p)
      for (int64_t l = 0; l < nl; ++l)
        xp[r0 + l] = code[l] == kOk ? static_cast<scalar_t>(static_cast<double>(ref[l]) +
                                                            td[l] * (sd[l] + delta[l]))
                                    : scalar_t(0);
    }
  });
}

// Gradients of p_i = F((z_i - x)/t) under sum_i p_i = k, with
// f_i = F'((z_i - x)/t) = min(p_i, 1 - p_i):
//   dL/dz_i = f_i / t * (g_i - gbar),   dL/dk = gbar,   gbar = sum f g / sum f.
// Rows [begin, end) of the backward; N > 0 is the row length known at compile
// time (the common short widths: the loops then have no runtime trip count and
// no remainder, which on short rows cost about as much as the arithmetic; at
// n = 128 the specialisation measured slower), 0 takes n at run time.
template <typename scalar_t, int64_t N>
__attribute__((always_inline)) inline void lapsum_backward_rows(
    const scalar_t* __restrict pp, const scalar_t* __restrict gp, const scalar_t* __restrict tp,
    scalar_t* __restrict dp, scalar_t* __restrict kp, int64_t n_run, int64_t begin, int64_t end) {
  const int64_t n = N > 0 ? N : n_run;
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
}

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
    switch (n) {
      case 8: return lapsum_backward_rows<scalar_t, 8>(pp, gp, tp, dp, kp, n, begin, end);
      case 16: return lapsum_backward_rows<scalar_t, 16>(pp, gp, tp, dp, kp, n, begin, end);
      case 32: return lapsum_backward_rows<scalar_t, 32>(pp, gp, tp, dp, kp, n, begin, end);
      case 64: return lapsum_backward_rows<scalar_t, 64>(pp, gp, tp, dp, kp, n, begin, end);
      default: return lapsum_backward_rows<scalar_t, 0>(pp, gp, tp, dp, kp, n, begin, end);
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

// log(u) for u > 0 (normal), written so that loops over it vectorise:
// u = 2^e m with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1)/(m + 1),
// |s| <= 0.172, by its odd series to s^23 (relative error below 1e-16).
__attribute__((always_inline)) inline double log_pos(double u) {
  uint64_t b;
  std::memcpy(&b, &u, sizeof b);
  // the exponent as a double from the bits of 2^52 + its field (exact; AVX2 has no
  // vector conversion from int64 to double, see exp_nonpos)
  const uint64_t eb = ((b >> 52) & 0x7ff) | 0x4330000000000000ull;
  double ed;
  std::memcpy(&ed, &eb, sizeof ed);
  ed = (ed - 4503599627370496.0) - 1023.0;
  uint64_t mb = (b & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
  double m;
  std::memcpy(&m, &mb, sizeof m);
  const bool big = m > 1.4142135623730951;
  m = big ? 0.5 * m : m;
  ed += big ? 1.0 : 0.0;
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double t = 1.0 / 23.0;
  t = t * s2 + 1.0 / 21.0;
  t = t * s2 + 1.0 / 19.0;
  t = t * s2 + 1.0 / 17.0;
  t = t * s2 + 1.0 / 15.0;
  t = t * s2 + 1.0 / 13.0;
  t = t * s2 + 1.0 / 11.0;
  t = t * s2 + 1.0 / 9.0;
  t = t * s2 + 1.0 / 7.0;
  t = t * s2 + 1.0 / 5.0;
  t = t * s2 + 1.0 / 3.0;
  t = t * s2 + 1.0;
  return ed * 6.93147180369123816490e-01 + (ed * 1.90821492927058770002e-10 + 2.0 * s * t);
}

// u^p for 0 < u <= 1 and p > 0 (so p log u <= 0), vectorisable; 0 for u <= 0.
// Subnormal u (below 2.2e-308) counts as 0.
__attribute__((always_inline)) inline double pow_unit(double u, double p) {
  const bool pos = u >= std::numeric_limits<double>::min();
  const double v = exp_nonpos<double>(p * log_pos(pos ? u : 1.0));
  return pos ? v : 0.0;
}

// log(u) for a normal float u > 0, vectorisable (the float counterpart of
// log_pos: exponent and mantissa from the bits, the mantissa in
// [sqrt(1/2), sqrt(2)), then 2 atanh(s) with s = (m - 1)/(m + 1), |s| < 0.172,
// to s^9: a relative error of about 2e-9 before the float roundings).
__attribute__((always_inline)) inline float log_pos_f(float u) {
  uint32_t b;
  std::memcpy(&b, &u, sizeof b);
  const uint32_t eb = ((b >> 23) & 0xffu) | 0x4b000000u;  // 2^23 + the exponent field
  float ed;
  std::memcpy(&ed, &eb, sizeof ed);
  ed = (ed - 8388608.0f) - 127.0f;
  const uint32_t mb = (b & 0x007fffffu) | 0x3f800000u;
  float m;
  std::memcpy(&m, &mb, sizeof m);
  const bool big = m > 1.41421356f;
  m = big ? 0.5f * m : m;
  ed += big ? 1.0f : 0.0f;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float t = 1.0f / 9.0f;
  t = t * s2 + 1.0f / 7.0f;
  t = t * s2 + 1.0f / 5.0f;
  t = t * s2 + 1.0f / 3.0f;
  t = t * s2 + 1.0f;
  return ed * 0.693145751953125f + (ed * 1.42860682030941723212e-6f + 2.0f * s * t);
}

// u^p in float for 0 < u <= 1 and p >= 0, vectorisable: relative error of a few
// float roundings (p |log u| below 87, the range of exp_nonpos<float>); 0 for u
// below the normal range.
__attribute__((always_inline)) inline float pow_unit_f(float u, float p) {
  const bool pos = u >= std::numeric_limits<float>::min();
  const float v = exp_nonpos<float>(p * log_pos_f(pos ? u : 1.0f));
  return pos ? v : 0.0f;
}

// log(1 + e) for e > -1 with 1 + e normal, vectorisable: log(u) for u = 1 + e
// rounded, plus the first-order correction for that rounding (u - 1 is exact).
__attribute__((always_inline)) inline double log1p_vec(double e) {
  const double u = 1.0 + e;
  return log_pos(u) + (e - (u - 1.0)) / u;
}

// (1 + e)^p for e in (-1, 0] and p > 0 as exp(p log1p(e)), vectorisable; 0 where
// 1 + e is not normal (e <= -1 included).
__attribute__((always_inline)) inline double pow1p(double e, double p) {
  const bool pos = 1.0 + e >= std::numeric_limits<double>::min();
  const double v = exp_nonpos<double>(p * log1p_vec(pos ? e : 0.0));
  return pos ? v : 0.0;
}

// General-alpha entmax and normmax, for any finite alpha > 1.
//
// Both maps threshold the row at the tau solving sum_i (y_i - tau)_+^power = 1,
//   alpha-entmax:  y = (alpha - 1)(z - max z), power = 1/(alpha - 1),
//                  p_i = (y_i - tau)_+^(1/(alpha - 1));
//   alpha-normmax: y = z - max z,             power = alpha/(alpha - 1),
//                  p_i = (y_i - tau)_+^(1/(alpha - 1)) / sum_j (same).
// y is formed as the PyTorch solvers form it, in the input's type (so the
// threshold law holds on the caller's gaps), but in double for normmax with
// alpha > 2; everything after is in double, for float32 input too. Per row:
//   1. tau >= -1 (the maximum alone gives 1), so only y_i > -1 can be in the
//      support: those candidates, usually a few, are collected.
//   2. alpha <= 2 (power >= 1): h(tau) =
//      ||(y - tau)_+||_power - 1 over the candidates is convex and decreasing
//      with h(-1) >= 0 > h(0), and nearly linear (exactly linear on one
//      score), so Newton's iteration from a lower bound of the root (-1, or
//      better: newton_start) climbs to it without passing it, in a few steps;
//      a step that would leave the bracket (rounding) is replaced by
//      bisection, and once the steps shrink quadratically the last,
//      confirming evaluation is skipped. Where h'' makes it worth it (not for
//      a large power), the step is Halley's, at most twice Newton's: it can
//      pass the root (about one row in ten), and then the row goes back to the
//      larger of two lower bounds, Newton's iterate from its last point below
//      the root and Newton's step from the point past it (h is convex: from
//      either side Newton's iterate is at or below the root), and on with
//      Newton alone. Evaluations per row, randn * 2 scores at 16 / 64
//      experts: entmax(1.3) 3.4 / 3.7 -> 3.0 / 3.1, normmax(3) 3.2 / 3.3 ->
//      2.5 / 2.6. No sort. The pows run through a
//      vectorisable exp/log (pow_unit: every u = y - tau lies in (0, 1]) over
//      candidates padded to whole vectors, and 8 rows iterate side by side.
//   3. alpha > 2 (the weights' exponent beta = 1/(alpha - 1) < 1, which
//      magnifies any rounding of y - tau near the threshold): the candidates
//      are sorted, descending; candidate k is in the support iff
//      S_k = sum_{i < k} (y_i - y_k)^power < 1, and S_k grows with k, so a
//      binary search finds the support size K. The threshold is then held as an
//      offset from the smallest support score y_r (see offset_weights in
//      _core.py): the unknown is y_r's weight x, G(x) = ties x^ct +
//      sum_{d_i > 0} (d_i + x^a)^power - 1 with d_i = y_i - y_r, a = alpha - 1
//      (ct = 1 for entmax, alpha for normmax), is increasing and convex on
//      [0, x_b] with G(0) < 0 <= G(x_b), and Newton's iteration from x_b
//      decreases to the root (bisection guards it the same way). The maximum's
//      terms enter G by their difference from 1, expm1(power log1p(w - h)),
//      h = 1 - d_max: near the threshold law's boundary (h tiny) G is decided
//      by w ~ h, which d_max + w would round away.
// A row costs two passes over its n scores (maximum, candidates) and a few
// pows per candidate per Newton step.
template <typename scalar_t, bool kNormmax>
void general_forward_impl(const at::Tensor& z, double alpha, at::Tensor& p, at::Tensor& status) {
  const int64_t rows = z.size(0), n = z.size(1);
  const scalar_t* zp = z.const_data_ptr<scalar_t>();
  scalar_t* pp = p.mutable_data_ptr<scalar_t>();
  int32_t* st = status.mutable_data_ptr<int32_t>();
  const double a = alpha - 1.0;
  const double power = kNormmax ? alpha / a : 1.0 / a;
  const double beta = 1.0 / a;  // exponent of the weights
  const scalar_t ys = kNormmax ? scalar_t(1) : static_cast<scalar_t>(a);
  const bool offset = alpha > 2.0;
  // a large power (alpha < 1.07): Newton on s = tau + 1 and the terms as
  // (1 + e)^power = exp(power log1p(e)), e = y - s (see newton_threshold in
  // _core.py: u = y - tau near 1 keeps only its absolute rounding, which the
  // power magnifies: 7e-10 off at alpha = 1 + 1e-8, 7e-8 at 1 + 1e-10)
  const bool sform = power >= 16.0;
  // the offset form (2b): y = sc z, and the ties' term of G is ties x^ct
  const double sc = kNormmax ? 1.0 : a, ct = kNormmax ? alpha : 1.0;
  // normmax, alpha > 2: y = z - max z in double, as the PyTorch solver (which runs
  // in float64 there) forms it: the weights' exponent 1/(alpha - 1) < 1 magnifies
  // the rounding of a float32 difference.
  const bool wide = kNormmax && alpha > 2.0;
  const double eps = std::numeric_limits<double>::epsilon();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> idx;
    std::vector<double> c, q;
    idx.reserve(n);
    c.reserve(n);
    q.assign(n, 0.0);
    // rows solved by Newton (2a) side by side, kRows at a time: their iterations
    // are independent, so the processor overlaps one row's chain of dependent
    // steps with another's
    // Each row's candidates are padded with -2 (u = -2 - tau < 0: weight 0) to a
    // multiple of kPad, so its loops run in whole vectors, never in a scalar tail.
    constexpr int kRows = 8;
    constexpr int64_t kPad = 8;
    // candidates per partial sum of the weights: kChunk padded groups, the chunk of the
    // sparse maps' sums along a row
    constexpr int64_t kSumChunk = kChunk * kPad;
    auto padded = [](int64_t m) { return (m + kPad - 1) / kPad * kPad; };
    const int64_t np = padded(n);
    std::vector<double> cb(kRows * np);
    std::vector<int64_t> ib(kRows * np);
    int64_t slot_row[kRows], slot_m[kRows];
    scalar_t slot_zmax[kRows];
    double slot_tau[kRows], slot_step[kRows], slot_lo_next[kRows];
    bool slot_halley[kRows], slot_was_halley[kRows];
    bool slot_active[kRows];
    // Newton's start: a lower bound of the root, so the iteration still climbs
    // to it. For any set S of candidates, 1 = ||(y - tau)_+||_power
    // >= |S|^(1/power - 1) sum_S (y_i - tau) (the power mean inequality), so
    // tau >= mean_S(y) - |S|^(-1/power); S runs over the candidates above
    // -j/8, j = 1..8 (counts and sums per eighth of (-1, 0]), and tau >= -1.
    std::vector<double> root_inv(n + 1, 0.0);  // |S|^(-1/power)
    for (int64_t j = 1; j <= n; ++j) root_inv[j] = std::pow(static_cast<double>(j), -1.0 / power);
    // (the counts and sums of the candidates above -j/8 for j = 1..8 in one pass,
    // each candidate a vector operation per group of edges: two groups of 4 with
    // AVX2 and AVX-512, four of 2 with 16-byte vectors, whole registers each. A
    // plain loop over the edges kept the sums scalar, behind a branch per edge that
    // the processor mispredicted: a fifth of the forward's time at 16 experts.)
    constexpr int64_t kEdgeLanes = std::min<int64_t>(4, kLanes<double>);
    constexpr int kEdgeGroups = static_cast<int>(8 / kEdgeLanes);
    using VE = vec_t<double, kEdgeLanes>;
    VE edges[kEdgeGroups];
    for (int g = 0; g < kEdgeGroups; ++g)
      for (int64_t l = 0; l < kEdgeLanes; ++l) edges[g][l] = -0.125 * (g * kEdgeLanes + l + 1);
    auto newton_start = [&](const double* cs, int64_t m) {
      const VE zero = VE{}, one = zero + 1.0;
      VE vcount[kEdgeGroups], vtotal[kEdgeGroups];
      for (int g = 0; g < kEdgeGroups; ++g) vcount[g] = vtotal[g] = zero;
      for (int64_t k = 0; k < m; ++k) {
        const VE y = zero + cs[k];
#pragma GCC unroll 4
        for (int g = 0; g < kEdgeGroups; ++g) {
          const auto above = y > edges[g];
          vcount[g] += above ? one : zero;
          vtotal[g] += above ? y : zero;
        }
      }
      double count[8], total[8];
      for (int g = 0; g < kEdgeGroups; ++g) {
        std::memcpy(count + g * kEdgeLanes, &vcount[g], sizeof(VE));
        std::memcpy(total + g * kEdgeLanes, &vtotal[g], sizeof(VE));
      }
      double start = -1.0;
      for (int j = 0; j < 8; ++j)
        if (count[j] > 0.0)
          start = std::max(start, total[j] / count[j] - root_inv[static_cast<int64_t>(count[j])]);
      // a few roundings below the bound: it can be the root itself (ties)
      return std::max(-1.0, start - 8.0 * eps);
    };
    // y of score i of a row, formed as the PyTorch solvers form it
    auto yof = [&](const scalar_t* zr, scalar_t zmax, int64_t i) {
      return wide ? static_cast<double>(zr[i]) - static_cast<double>(zmax)
                  : static_cast<double>((zr[i] - zmax) * ys);
    };
    // 2b, for one row (pr zeroed, candidates' indices is[0..m)): the candidates
    // sorted by score, descending; the support size by a binary search, then the
    // frame score's weight by Newton's iteration on G.
    auto offset_row = [&](const scalar_t* zr, scalar_t* pr, scalar_t zmax, const int64_t* is,
                          int64_t m) {
          idx.assign(is, is + m);
          std::sort(idx.begin(), idx.end(), [&](int64_t i, int64_t j) { return zr[i] > zr[j]; });
          c.resize(m);
          for (int64_t k = 0; k < m; ++k) c[k] = yof(zr, zmax, idx[k]);
          // the support size K: the largest k (1-based) with S_k < 1
          auto S = [&](int64_t k) {  // k 0-based: sum over i < k of (c_i - c_k)^power
            double s = 0.0;
            for (int64_t i = 0; i < k; ++i) {
              const double d = c[i] - c[k];
              s += d > 0.0 ? std::pow(d, power) : 0.0;
            }
            return s;
          };
          int64_t lo_k = 0, hi_k = m;  // S(lo_k) < 1 (S(0) = 0); index hi_k is out
          while (hi_k - lo_k > 1) {
            const int64_t mid = (lo_k + hi_k) / 2;
            if (S(mid) < 1.0) lo_k = mid; else hi_k = mid;
          }
          const int64_t K = lo_k + 1;
          if (K == 1) {
            pr[idx[0]] = scalar_t(1);
            return;
          }
          double total = 0.0;
          {
            // the weight x of the frame score z_r (the smallest in the support);
            // d_k = sc (z_k - z_r), G(x) = ties x^ct + sum_{d > 0} (d + x^a)^power - 1
            const double zrf = static_cast<double>(zr[idx[K - 1]]);
            const double zm = static_cast<double>(zmax);
            const double h = 1.0 + sc * (zrf - zm);  // 1 - d at the maximum
            double wb = h;  // tau >= max(y) - 1
            if (K < m) wb = std::min(wb, sc * (zrf - static_cast<double>(zr[idx[K]])));
            const double xb = std::pow(std::max(wb, 0.0), beta);
            double ties = 0.0, n_top = 0.0;
            for (int64_t k = 0; k < K; ++k) {
              const double d = sc * (static_cast<double>(zr[idx[k]]) - zrf);
              q[k] = d;  // d_k, the weights replace it below
              ties += d > 0.0 ? 0.0 : 1.0;
              // (h <= 1/2: h = 1 + y_r is exact there; a small d_max is lost in h)
              n_top += (d > 0.0 && zr[idx[k]] == zmax && h <= 0.5) ? 1.0 : 0.0;
            }
            double x = xb, lo = 0.0;
            for (int it = 0; it < 200; ++it) {
              const double w = std::pow(x, a);
              const double tied = ties * (kNormmax ? std::pow(x, ct) : x);
              // the maximum's terms by their difference from 1 (see offset_weights
              // in _core.py): expm1(power log1p(w - h)), without cancellation
              const double em = n_top > 0.0 ? n_top * std::expm1(power * std::log1p(w - h)) : 0.0;
              double rest = tied, sl = tied;
              for (int64_t k = 0; k < K; ++k) {
                if (!(q[k] > 0.0)) continue;
                const double u = q[k] + w;
                const double v = std::pow(u, power);
                rest += (n_top > 0.0 && zr[idx[k]] == zmax) ? 0.0 : v;
                sl += v * (w / u);  // (w / u <= 1: v / u alone can overflow)
              }
              const double g = rest + em + (n_top - 1.0);
              const double tol = 4.0 * eps * (rest + std::abs(em) + std::abs(n_top - 1.0));
              if (std::abs(g) <= tol) break;
              if (g < 0.0) {  // left of the root (rounding): a bracket end
                lo = x;
                break;
              }
              // d/dx (d + x^a)^power = ct v (w / u) / x, d/dx ties x^ct = ct tied / x
              const double slope = x > 0.0 ? ct * sl / x : (kNormmax ? 0.0 : ties);
              double next = slope > 0.0 ? x - g / slope : lo;
              if (!(next < x)) break;  // no progress: rounding floor
              if (!(next > lo)) next = 0.5 * (x + lo);
              if (!(x - next > 4.0 * eps * x)) {
                x = next;
                break;
              }
              x = next;
            }
            const double w = std::pow(x, a);
            for (int64_t k = 0; k < K; ++k) {
              q[k] = q[k] > 0.0 ? std::pow(q[k] + w, beta) : x;
              total += q[k];
            }
          }
          // normalising removes the solver's last rounding (and is normmax's p)
          const double inv = 1.0 / total;
          for (int64_t k = 0; k < K; ++k) pr[idx[k]] = static_cast<scalar_t>(q[k] * inv);
    };
    for (int64_t r0 = begin; r0 < end; r0 += kRows) {
      const int64_t r1 = std::min<int64_t>(end, r0 + kRows);
      int nb = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* zr = zp + r * n;
        scalar_t* pr = pp + r * n;
        scalar_t zmax;
        const int code = row_max(zr, n, zmax);
        st[r] = code;
        if (code != kOk) {
          for (int64_t i = 0; i < n; ++i) pr[i] = scalar_t(0);
          continue;
        }
        // 1. candidates y_i > -1
        // (compacted into the block's next slot without a branch: every score is
        // written, and the count moves past it when it is a candidate)
        double* cs = cb.data() + nb * np;
        int64_t* is = ib.data() + nb * np;
        int64_t m = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double y = yof(zr, zmax, i);
          cs[m] = y;
          is[m] = i;
          m += y > -1.0 ? 1 : 0;
        }
        for (int64_t i = 0; i < n; ++i) pr[i] = scalar_t(0);
        if (m == 1) {  // the maximum alone: one-hot
          pr[is[0]] = scalar_t(1);
          continue;
        }
        if (!offset || kNormmax) {
          // 2a. power >= 1: Newton on h(tau) = ||(y - tau)_+||_power - 1 over the
          // candidates, from a lower bound of the root (newton_start). h is convex
          // and decreasing, so the iterates climb to the root without passing it;
          // no sort is needed. The row joins the block's lockstep iteration below.
          for (int64_t k = m; k < padded(m); ++k) cs[k] = -2.0;
          slot_row[nb] = r;
          slot_zmax[nb] = zmax;
          slot_m[nb] = m;
          // (s = tau + 1 from the start on, for a large power; newton_start's
          // margin of 8 eps covers the rounding of + 1)
          slot_tau[nb] = newton_start(cs, m) + (sform ? 1.0 : 0.0);
          slot_step[nb] = std::numeric_limits<double>::infinity();
          slot_lo_next[nb] = slot_tau[nb];
          slot_halley[nb] = !sform;
          slot_was_halley[nb] = false;
          slot_active[nb] = true;
          ++nb;
          continue;
        }
        // 2b. alpha > 2 (entmax): the threshold as an offset from a score
        offset_row(zr, pr, zmax, is, m);
      }
      // 2a, continued: the Newton iterations of the block's rows in lockstep, each
      // iteration in three phases: the sums of every active row, then the norms
      // sp^(1/power) of all the block's rows in one vector loop (a row's log and exp
      // are one chain of about 30 dependent operations: row by row they were a third
      // of the kernel's time at 16 experts), then each row's step.
      double slot_sp[kRows], slot_sd[kRows], slot_sdd[kRows], slot_norm[kRows];
      const double inf = std::numeric_limits<double>::infinity();
      for (int it = 0; it < 200; ++it) {
        for (int b = 0; b < kRows; ++b) slot_sp[b] = slot_sd[b] = slot_sdd[b] = 0.0;
        for (int b = 0; b < nb; ++b) {
          if (!slot_active[b]) continue;
          const double* cs = cb.data() + b * np;
          const int64_t m = padded(slot_m[b]);
          // tau, or s = tau + 1 (sform)
          const double tau = slot_tau[b];
          // sum u^power, u^(power - 1) and (not sform) u^(power - 2) over u > 0
          // (u <= 1: every y <= 0 and tau >= -1)
          double sp = 0.0, sd = 0.0, sdd = 0.0;
          if (sform) {
#pragma omp simd reduction(+ : sp, sd)
            for (int64_t k = 0; k < m; ++k) {
              const double e = cs[k] - tau, u = 1.0 + e;
              const double v = pow1p(e, power);
              sp += v;
              sd += v > 0.0 ? v / u : 0.0;
            }
          } else {
#pragma omp simd reduction(+ : sp, sd, sdd)
            for (int64_t k = 0; k < m; ++k) {
              const double u = cs[k] - tau;
              const bool in = u > 0.0;
              const double v = pow_unit(u, power);
              const double r = in ? 1.0 / u : 0.0;
              const double d = v * r;
              sp += v;
              sd += d;
              sdd += d * r;
            }
          }
          slot_sp[b] = sp;
          slot_sd[b] = sd;
          slot_sdd[b] = sdd;
        }
        // the norm sp^(1/power), through log and exp (0 where sp is 0)
#pragma omp simd
        for (int b = 0; b < kRows; ++b) {
          const double sp = slot_sp[b] > 0.0 ? slot_sp[b] : 1.0;
          const double x = log_pos(sp) / power;
          const double norm = sp > 1.0 ? 1.0 / exp_nonpos<double>(-x) : exp_nonpos<double>(x);
          slot_norm[b] = slot_sp[b] > 0.0 ? norm : 0.0;
        }
        bool any = false;
        const double hi = sform ? 1.0 : 0.0;  // the bracket's upper end
        for (int b = 0; b < nb; ++b) {
          if (!slot_active[b]) continue;
          slot_active[b] = false;
          const double sp = slot_sp[b], tau = slot_tau[b], norm = slot_norm[b];
          const double h = norm - 1.0;  // > 0 iff sp > 1
          const double slope = sp > 0.0 ? slot_sd[b] * norm / sp : 0.0;  // -h'
          if (!(sp > 1.0)) {
            // at the root to rounding, or (after a Halley step, which can pass it)
            // past it: back below it to the larger of two lower bounds, Newton's
            // iterate from the last point below the root and Newton's step from
            // here (h is convex: from either side, its iterate is at or below the
            // root), then Newton alone for this row
            if (!(slot_was_halley[b] && sp < 1.0)) continue;
            double back = slot_lo_next[b];
            if (slope > 0.0 && h / slope < 0.0) back = std::max(back, tau + h / slope);
            slot_tau[b] = std::min(back, tau);
            slot_step[b] = inf;
            slot_halley[b] = slot_was_halley[b] = false;
            slot_active[b] = any = true;
            continue;
          }
          if (!(h > 0.0)) continue;
          const double dn = h / slope;  // Newton's step
          double next = tau + dn;
          bool newton = true, halley = false;
          if (!(next < hi)) {  // a step out of the bracket: bisect
            next = 0.5 * (tau + hi);
            newton = false;
          }
          slot_lo_next[b] = next;  // (a lower bound of the root)
          if (newton && slot_halley[b]) {
            // Halley's step dn / (1 - L), L = h h'' / (2 h'^2), with
            // h'' = (power - 1) (norm / sp) (sum u^(power - 2) - sd^2 / sp) >= 0:
            // taken while L < 1/2 (at most twice Newton's step) and inside the
            // bracket
            const double sd = slot_sd[b];
            const double hpp = (power - 1.0) * (norm / sp) * (slot_sdd[b] - sd * (sd / sp));
            const double L = h * hpp / (2.0 * slope * slope);
            if (L > 0.0 && L < 0.5) {
              const double nh = tau + dn / (1.0 - L);
              if (nh < hi) {
                next = nh;
                halley = true;
              }
            }
          }
          if (!(next > tau)) continue;  // no progress: rounding floor
          // The steps shrink quadratically near the root (Newton: d' ~ c d^2;
          // Halley: d' ~ c d^3; c estimated from the last two steps): when the next
          // one would be below an eighth of tau's rounding, this step reaches the
          // root and the iteration that would only confirm it is skipped.
          const double step = next - tau, prev = slot_step[b];
          slot_tau[b] = next;
          slot_step[b] = newton ? step : inf;
          slot_was_halley[b] = halley;
          const double ratio = step / prev;
          const double predicted = halley ? step * ratio * ratio * ratio : step * ratio * ratio;
          if (newton && prev < inf && step < 0.1 * prev &&
              predicted <= 0.125 * eps * std::abs(next))
            continue;
          slot_active[b] = any = true;
        }
        if (!any) break;
      }
      for (int b = 0; b < nb; ++b) {
        double* cs = cb.data() + b * np;
        const int64_t* is = ib.data() + b * np;
        const int64_t m = slot_m[b];
        const double tau = slot_tau[b];
        scalar_t* pr = pp + slot_row[b] * n;
        // worst: max over the support of q / u; near: the smallest |u|
        double total = 0.0, worst = 0.0, near = 1.0;
        // NOTE: summed in chunks of kSumChunk candidates (one chunk, as before, up to
        // that width): a vector reduction over a whole wide row runs each lane
        // through m / lanes additions, whose rounding on a flat row of 65536 reached
        // 6e-13 relative with AVX2's 4 lanes (AVX-512's 8 stayed below 1e-13)
        for (int64_t c0 = 0; c0 < padded(m); c0 += kSumChunk) {
          const int64_t c1 = std::min<int64_t>(padded(m), c0 + kSumChunk);
          double part = 0.0;
          if (sform) {
#pragma omp simd reduction(+ : part)
            for (int64_t k = c0; k < c1; ++k) {
              cs[k] = pow1p(cs[k] - tau, beta);
              part += cs[k];
            }
          } else if (offset) {
#pragma omp simd reduction(+ : part) reduction(max : worst) reduction(min : near)
            for (int64_t k = c0; k < c1; ++k) {
              const double u = cs[k] - tau;
              cs[k] = pow_unit(u, beta);
              part += cs[k];
              worst = std::max(worst, u > 0.0 ? cs[k] / u : 0.0);
              near = std::min(near, std::abs(u));
            }
          } else {
#pragma omp simd reduction(+ : part)
            for (int64_t k = c0; k < c1; ++k) {
              cs[k] = pow_unit(cs[k] - tau, beta);
              part += cs[k];
            }
          }
          total += part;
        }
        // normmax with alpha > 2 (beta < 1): a weight q = u^beta is off by about
        // beta eps q / u relative to the sum, from the rounding of u = y - tau, and
        // a score within rounding of tau may or may not be in the support; where
        // either could pass 1e-13, the row is solved again in the offset form
        // ([[0, -0.9999999999999999]] at alpha = 50 gave 0.3209 for 0.3192)
        if (offset && (near <= 4.0 * eps || beta * 4.0 * eps * worst > 1e-13 * total)) {
          offset_row(zp + slot_row[b] * n, pr, slot_zmax[b], is, m);
          continue;
        }
        const double inv = 1.0 / total;  // removes the solver's last rounding
        for (int64_t k = 0; k < m; ++k) pr[is[k]] = static_cast<scalar_t>(cs[k] * inv);
      }
    }
  });
}

// The largest alpha whose normmax backward takes p^alpha in float for float
// scores (above it, most small weights would fall below the float power's floor).
constexpr double kFloatPowAlpha = 4.0;

// The backward's powers in float (for float32 gradients): tf_i = t_i^p through
// pow_unit_f where t_i >= least, else 0. Returns how many positive t_i lie below
// least (their powers are the caller's to take in double).
inline int64_t float_powers(const double* __restrict t, float* __restrict tf, int64_t n,
                            double p, double least) {
  const float pf = static_cast<float>(p);
  int64_t below = 0;
#pragma omp simd reduction(+ : below)
  for (int64_t i = 0; i < n; ++i) {
    const bool ok = t[i] >= least;
    tf[i] = ok ? pow_unit_f(static_cast<float>(t[i]), pf) : 0.0f;
    below += (!ok && t[i] > 0.0) ? 1 : 0;
  }
  return below;
}

// Backward of the general-alpha maps, in double.
//   entmax:  J^T g = s (g - q), s_i = p_i^(2 - alpha) on the support,
//            q = <s, g> / sum(s). s is taken relative to its largest entry m
//            (t = (p / p_m)^(2 - alpha) <= 1: for alpha > 2 s itself can
//            overflow), and entry m is minus the sum of the others.
//   normmax: with 1/S = ||p||_alpha, h = (g - <g, p>) / S and
//            r_i = (p_i S)^(2 - alpha) / (alpha - 1) on the support,
//            J^T g = h r - <h, r> p.
// One power per support entry, through the vectorisable pow_unit (every base
// lies in (0, 1]): entmax's t_i, from which s_i = t_i p_m^(2 - alpha); normmax's
// p_i^alpha, from which (p_i S)^(2 - alpha) = (p_i S)^2 / (p_i S)^alpha. Where
// that shortcut would lose the value (p_m^(2 - alpha) not finite, p_i^alpha
// below the normal range), the entry takes std::pow. For float32 gradients the
// powers are taken in float (pow_unit_f: twice the lanes, polynomials of half
// the degree) where that keeps them normal: entmax with alpha <= 2, normmax with
// alpha <= kFloatPowAlpha; the sums stay in double.
template <typename scalar_t, bool kNormmax>
void general_backward_impl(const at::Tensor& p, const at::Tensor& g, double alpha,
                           at::Tensor& dz) {
  const int64_t rows = p.size(0), n = p.size(1);
  const scalar_t* pp = p.const_data_ptr<scalar_t>();
  const scalar_t* gp = g.const_data_ptr<scalar_t>();
  scalar_t* dp = dz.mutable_data_ptr<scalar_t>();
  const double e = 2.0 - alpha;
  const double tiny = std::numeric_limits<double>::min();
  // normmax, float scores: the smallest p whose p^alpha is taken in float
  const double pow_floor = std::exp(-80.0 / alpha);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<double> t(n), gd(n);
    std::vector<float> tf(n);  // (float scores: the powers in float)
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* pr = pp + r * n;
      const scalar_t* gr = gp + r * n;
      scalar_t* dr = dp + r * n;
      if constexpr (kNormmax) {
        double pa = 0.0, gpd = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          gd[i] = static_cast<double>(gr[i]);
          t[i] = static_cast<double>(pr[i]);
        }
        bool in_float = std::is_same_v<scalar_t, float> && alpha <= kFloatPowAlpha;
        if (in_float) {
          // float scores: p^alpha in float (as the entmax backward's powers), where
          // p >= pow_floor (alpha |log p| <= 80: the power stays normal). A smaller p
          // gets 0 here: its p^alpha < e^-80 is lost from the sum (relative to its
          // largest term, at most n e^-80 n^alpha), and its r below is taken from
          // std::pow, as for any p^alpha below the double's normal range.
          float_powers(t.data(), tf.data(), n, alpha, pow_floor);
#pragma omp simd reduction(+ : pa, gpd)
          for (int64_t i = 0; i < n; ++i) {
            const double pi = t[i];
            const double v = static_cast<double>(tf[i]);
            t[i] = v;
            pa += v;
            gpd += pi * gd[i];
          }
          // (every weight below the floor, which no normmax output has: its largest
          // weight is at least 1/n; the double powers then)
          in_float = pa > 0.0;
          if (!in_float) {
            pa = gpd = 0.0;
            for (int64_t i = 0; i < n; ++i) t[i] = static_cast<double>(pr[i]);
          }
        }
        if (!in_float) {
#pragma omp simd reduction(+ : pa, gpd)
          for (int64_t i = 0; i < n; ++i) {
            const double pi = t[i];
            const double v = pow_unit(pi, alpha);  // 0 off the support
            t[i] = v;
            pa += v;
            gpd += pi * gd[i];
          }
        }
        const double inv_s = std::pow(pa, 1.0 / alpha);
        const double s = 1.0 / inv_s;
        const double sa = 1.0 / pa;  // S^alpha
        const double inv_am1 = 1.0 / (alpha - 1.0);
        double hr_sum = 0.0;
        int64_t odd = 0;  // support entries whose p^alpha fell below the normal range
#pragma omp simd reduction(+ : hr_sum, odd)
        for (int64_t i = 0; i < n; ++i) {
          const double pi = static_cast<double>(pr[i]);
          const double w = pi * s;  // p_i S in (0, 1]
          const bool ok = t[i] >= tiny;
          const double rv = ok ? w * w / (t[i] * sa) * inv_am1 : 0.0;  // 0 off the support
          odd += (!ok && pi > 0.0) ? 1 : 0;
          hr_sum += (gd[i] - gpd) * inv_s * rv;
          t[i] = rv;
        }
        if (odd > 0)
          for (int64_t i = 0; i < n; ++i) {
            const double pi = static_cast<double>(pr[i]);
            if (!(pi > 0.0) || t[i] > 0.0) continue;
            const double rv = std::pow(pi * s, e) * inv_am1;
            hr_sum += (gd[i] - gpd) * inv_s * rv;
            t[i] = rv;
          }
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const double pi = static_cast<double>(pr[i]);  // t and p are 0 off the support
          dr[i] = static_cast<scalar_t>((gd[i] - gpd) * inv_s * t[i] - hr_sum * pi);
        }
      } else {
        // m: the support entry with the largest s (the largest p for alpha < 2,
        // the smallest positive p for alpha > 2; the first one on ties)
        // (two branch-free passes: the extreme value, then its first index)
        double best = e >= 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
        if (e >= 0.0) {
          for (int64_t i = 0; i < n; ++i) best = std::max(best, static_cast<double>(pr[i]));
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const double pi = static_cast<double>(pr[i]);
            best = std::min(best, pi > 0.0 ? pi : std::numeric_limits<double>::infinity());
          }
        }
        int64_t m = -1;
        if (best > 0.0 && best < std::numeric_limits<double>::infinity())
          for (int64_t i = 0; i < n; ++i)
            if (static_cast<double>(pr[i]) == best) {
              m = i;
              break;
            }
        if (m < 0) {  // a zero row (its forward reported an error)
          for (int64_t i = 0; i < n; ++i) dr[i] = scalar_t(0);
          continue;
        }
        const double pm = static_cast<double>(pr[m]);
        const double ipm = 1.0 / pm;
        for (int64_t i = 0; i < n; ++i) gd[i] = static_cast<double>(gr[i]);
        // the bases of t, in (0, 1] (0 off the support), then the powers: two
        // plain loops over doubles, which vectorise whole
        if (e >= 0.0) {
          for (int64_t i = 0; i < n; ++i) {
            const double pi = static_cast<double>(pr[i]);
            t[i] = pi > 0.0 ? std::min(pi * ipm, 1.0) : 0.0;  // p_i / p_m, p_i <= p_m
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const double pi = static_cast<double>(pr[i]);
            t[i] = pi > 0.0 ? std::min(pm / pi, 1.0) : 0.0;  // p_m / p_i, p_m <= p_i
          }
        }
        const double ea = std::abs(e);
        double ts = 0.0, tg = 0.0;
        if (std::is_same_v<scalar_t, float> && e >= 0.0) {
          // float scores, alpha <= 2: the powers t^(2 - alpha) in float, twice the
          // lanes and polynomials of half the degree, for gradients that are
          // float. t >= kFloatBase gives a power of at least kFloatBase in the
          // normal range (2 - alpha <= 1); the rarer, smaller bases take the
          // double power.
          constexpr double kFloatBase = 1e-30;
          const int64_t odd = float_powers(t.data(), tf.data(), n, ea, kFloatBase);
#pragma omp simd reduction(+ : ts, tg)
          for (int64_t i = 0; i < n; ++i) {
            const double v = static_cast<double>(tf[i]);
            ts += v;
            tg += v * gd[i];
          }
          if (odd > 0) {
            for (int64_t i = 0; i < n; ++i)
              if (t[i] > 0.0 && t[i] < kFloatBase) {
                tf[i] = static_cast<float>(pow_unit(t[i], ea));
                ts += static_cast<double>(tf[i]);
                tg += static_cast<double>(tf[i]) * gd[i];
              }
          }
          for (int64_t i = 0; i < n; ++i) t[i] = static_cast<double>(tf[i]);
        } else {
#pragma omp simd reduction(+ : ts, tg)
          for (int64_t i = 0; i < n; ++i) {
            const double v = pow_unit(t[i], ea);
            t[i] = v;
            ts += v;
            tg += v * gd[i];
          }
        }
        const double qv = tg / ts;
        const double sm = std::pow(pm, e);  // s_m: s_i = t_i s_m
        const bool scaled = std::isfinite(sm) && sm > 0.0;
        double rest = 0.0;
        if (scaled) {  // t is 0 off the support and, set here, at m: so is v
          t[m] = 0.0;
#pragma omp simd reduction(+ : rest)
          for (int64_t i = 0; i < n; ++i) {
            const double v = t[i] * sm * (gd[i] - qv);
            rest += v;
            dr[i] = static_cast<scalar_t>(v);
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const double pi = static_cast<double>(pr[i]);
            double v = 0.0;
            if (pi > 0.0 && i != m) v = std::pow(pi, e) * (gd[i] - qv);
            rest += v;
            dr[i] = static_cast<scalar_t>(v);
          }
        }
        dr[m] = static_cast<scalar_t>(-rest);
      }
    }
  });
}

template <bool kNormmax>
std::tuple<at::Tensor, at::Tensor> general_forward(const at::Tensor& z, double alpha) {
  check_matrix(z, kNormmax ? "moelab normmax" : "moelab entmax");
  TORCH_CHECK(alpha > 1.0 && std::isfinite(alpha), "moelab maps: alpha must be finite and > 1");
  at::Tensor p = at::empty_like(z);
  at::Tensor status = at::empty({z.size(0)}, z.options().dtype(at::kInt));
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "moelab_general_forward", [&] {
    general_forward_impl<scalar_t, kNormmax>(z, alpha, p, status);
  });
  return {p, status};
}

template <bool kNormmax>
at::Tensor general_backward(const at::Tensor& p, const at::Tensor& g, double alpha) {
  check_matrix(p, kNormmax ? "moelab normmax backward" : "moelab entmax backward");
  TORCH_CHECK(alpha > 1.0 && std::isfinite(alpha), "moelab maps: alpha must be finite and > 1");
  at::Tensor gc = g.contiguous().to(p.scalar_type());
  at::Tensor dz = at::empty_like(p);
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "moelab_general_backward", [&] {
    general_backward_impl<scalar_t, kNormmax>(p, gc, alpha, dz);
  });
  return dz;
}


// What this build is (moelab_maps_info; moelab bench maps and the tests read it).

// The widest vector instruction set the compiler was allowed (-march): what the
// vector types above compile to.
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__AVX__)
  return "avx";
#elif defined(__SSE2__)
  return "sse2";
#elif defined(__ARM_FEATURE_SVE)
  return "sve";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "generic";
#endif
}

// Bytes of the kernels' vector types (the lanes of a block: kLanes).
int64_t vector_bytes() { return kVecBytes; }

template <typename scalar_t>
std::string paths_of(const std::string& op, int64_t n) {
  const std::string lanes = "lanes" + std::to_string(kLanes<scalar_t>);
  const std::string row = "row" + std::to_string(row_width<scalar_t>(n));
  const std::string along = "row" + std::to_string(kRowW<scalar_t>);
  if (op == "sparsemax")
    return (sparse_by_lanes<scalar_t, Sparse::kSparsemax>(n) ? lanes : along) + " " + row;
  if (op == "entmax15")
    return (sparse_by_lanes<scalar_t, Sparse::kEntmax15>(n) ? lanes : along) + " " + row;
  if (op == "normmax2")
    return (sparse_by_lanes<scalar_t, Sparse::kNormmax2>(n) ? lanes : along) + " " + row;
  if (op == "lapsum")
    return lanes + " " +
           ((n == 8 || n == 16 || n == 32 || n == 64) ? "row-n" + std::to_string(n) : "row-any");
  if (op == "entmax" || op == "normmax") return "row-scalar row-scalar";
  TORCH_CHECK(false, "moelab_maps_info::paths: unknown op ", op);
}

// The kernel path of op's forward and backward on rows of n entries of a dtype
// of itemsize bytes, as "<forward> <backward>": lanesL (a block of L rows across
// the L lanes of a vector), rowW (along the row in W-lane vectors), row-nN (the
// backward specialised for n = N), row-any, row-scalar (along the row, the
// compiler's own vectorisation).
std::string paths(const std::string& op, int64_t n, int64_t itemsize) {
  TORCH_CHECK(n >= 1 && (itemsize == 4 || itemsize == 8),
              "moelab_maps_info::paths: n >= 1 and itemsize 4 or 8");
  return itemsize == 4 ? paths_of<float>(op, n) : paths_of<double>(op, n);
}

}  // namespace
}  // namespace moelab

TORCH_LIBRARY(moelab_maps_info, m) {
  m.def("isa() -> str", &moelab::isa);
  m.def("vector_bytes() -> int", &moelab::vector_bytes);
  m.def("paths(str op, int n, int itemsize) -> str", &moelab::paths);
}

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
  m.def("entmax_forward(Tensor z, float alpha) -> (Tensor, Tensor)",
        &moelab::general_forward<false>);
  m.def("normmax_forward(Tensor z, float alpha) -> (Tensor, Tensor)",
        &moelab::general_forward<true>);
  m.def("entmax_backward(Tensor p, Tensor g, float alpha) -> Tensor",
        &moelab::general_backward<false>);
  m.def("normmax_backward(Tensor p, Tensor g, float alpha) -> Tensor",
        &moelab::general_backward<true>);
}
