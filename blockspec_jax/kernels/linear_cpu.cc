// Linear layer for CPU decoding: y[m, n] = sum_k x[m, k] * w[n, k], for any number of rows M.
//
//   x  float32 [M, K]   activations (M = batch rows x tokens per row: B for a decode step, B*(γ+1) for a verify pass)
//   w  float32 or bfloat16 [N, K]   weights in (out, in) layout, streamed from memory once per call
//   y  float32 [M, N]
//
// Why: at decode time a linear layer reads N*K weights to do M*N*K multiply-adds. A general GEMM (Eigen, oneDNN,
// OpenBLAS) packs the weight panel first and costs 1.5-3x a matrix-vector product already at M = 2..5 on a 2-core
// AVX2 machine, which is exactly the verify pass of speculative decoding. This kernel streams each weight row once and
// applies it to the activation rows while it is in registers, so a pass over γ+1 tokens costs about what a
// single-token step costs as long as the FMA units keep up with memory (M <= ~16 on AVX2). Wider passes (large
// batches) are compute-bound: rows and weight rows are then tiled in L2-sized blocks (rows_avx2).
//
// Determinism: every y[m, n] is summed in one fixed order (8 lanes over k in steps of 8, a fixed horizontal
// reduction, then the k tail) that does not depend on M, on the blocking of m and n, or on the thread split. So a
// row's logits are bit-identical whether it is computed alone (autoregressive step), inside a multi-token pass, or
// next to any number of other rows.
//
// Threads: the call runs on XLA's own intra-op thread pool (the FFI ThreadPool context), so it never competes with
// a second set of threads for the cores. N is cut into chunks (multiples of 4 rows); the calling thread and the
// tasks it schedules claim chunks from one atomic counter, so the caller finishes the work alone if every pool
// thread is busy (no deadlock when XLA runs several custom calls at once), and waits only for chunks another thread
// has already started. BLOCKSPEC_JAX_KERNEL_THREADS caps the threads used (default: XLA's pool size).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BSJ_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Weight element loaders.

inline float load_scalar(const float* w) { return *w; }
inline float load_scalar(const uint16_t* w) {
  uint32_t bits = static_cast<uint32_t>(*w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// ---------------------------------------------------------------------------------------------------------------
// Portable path: the same summation order as the AVX2 path (8 partial sums over k mod 8, pairwise reduction, tail).

template <typename WT>
void rows_generic(const float* x, const WT* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t k8 = K - K % 8;
  for (int64_t n = n0; n < n1; ++n) {
    const WT* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < k8; k += 8) {
        for (int j = 0; j < 8; ++j) lane[j] = std::fma(load_scalar(wn + k + j), xm[k + j], lane[j]);
      }
      // Reduction order of the AVX2 path: (0+4, 1+5, 2+6, 3+7), then (a+c, b+d), then (e+f).
      float a = lane[0] + lane[4], b = lane[1] + lane[5], c = lane[2] + lane[6], d = lane[3] + lane[7];
      float e = a + c, f = b + d;
      float acc = e + f;
      for (int64_t k = k8; k < K; ++k) acc = std::fma(load_scalar(wn + k), xm[k], acc);
      y[m * N + n] = acc;
    }
  }
}

#ifdef BSJ_X86
// ---------------------------------------------------------------------------------------------------------------
// AVX2 + FMA path. A micro-kernel applies NR weight rows to MR activation rows per pass over k, holding NR*MR
// accumulators; the activation operand of each FMA comes straight from memory (L1/L2 resident).

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  // (0+4, 1+5, 2+6, 3+7) -> (a+c, b+d) -> (e+f): matches rows_generic.
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                    // a b c d
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));    // a+c b+d . .
  __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));  // (a+c)+(b+d)
  return _mm_cvtss_f32(u);
}

template <int MR, int NR, typename WT>
__attribute__((target("avx2,fma"))) inline void micro(const float* x, const WT* w, float* y, int64_t N, int64_t K,
                                                      int64_t m0, int64_t n0) {
  const int64_t k8 = K - K % 8;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const WT* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = w + (n0 + j) * K;
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * K;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(wr[j] + k);
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(xr[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) s = std::fma(load_scalar(wr[j] + k), xr[i][k], s);
      y[(m0 + i) * N + n0 + j] = s;
    }
  }
}

template <int NR, typename WT>
__attribute__((target("avx2,fma"))) void rows_avx2_nr(const float* x, const WT* w, float* y, int64_t M, int64_t N,
                                                       int64_t K, int64_t n) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) micro<3, NR>(x, w, y, N, K, m, n);
  if (M - m == 2) micro<2, NR>(x, w, y, N, K, m, n);
  if (M - m == 1) micro<1, NR>(x, w, y, N, K, m, n);
}

// Cache blocking for any M: weight rows [n0, n1) are taken in blocks of about kWeightBlockBytes (L2 resident) and,
// inside a block, activation rows in equal tiles of at most about kRowTileBytes (a multiple of 3 rows, L2 resident),
// so a wide pass (many rows) re-reads both from L2 instead of streaming all of x from memory for every 4 weight rows.
// bfloat16 weights applied to more than kWidenRows rows are widened to float32 once per block (into a per-thread
// scratch buffer) instead of once per 3 rows. With M <= one tile this is the plain loop. Blocking, tiling and widening
// (exact) only reorder whole outputs, never the sum of one, so they change no bits.
constexpr int64_t kWeightBlockBytes = 128 << 10;
constexpr int64_t kRowTileBytes = 128 << 10;
constexpr int64_t kWidenRows = 6;

template <typename WT>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, const WT* w, float* y, int64_t M, int64_t N,
                                                    int64_t K, int64_t n0, int64_t n1, int64_t tile) {
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const int64_t mt = std::min(tile, M - m0);
    const float* xt = x + m0 * K;
    float* yt = y + m0 * N;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_avx2_nr<4>(xt, w, yt, mt, N, K, n);
    for (; n < n1; ++n) rows_avx2_nr<1>(xt, w, yt, mt, N, K, n);
  }
}

__attribute__((target("avx2,fma"))) void widen_avx2(const uint16_t* w, float* out, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, load8(w + i));
  for (; i < count; ++i) out[i] = load_scalar(w + i);
}

template <typename WT>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const WT* w, float* y, int64_t M, int64_t N,
                                                   int64_t K, int64_t n0, int64_t n1) {
  if (M <= 0) return;
  constexpr bool kBf16 = !std::is_same<WT, float>::value;
  const bool widen = kBf16 && M > kWidenRows;
  const int64_t w_bytes = widen ? int64_t(sizeof(float)) : int64_t(sizeof(WT));
  const int64_t block = std::max<int64_t>(4, kWeightBlockBytes / (K * w_bytes) / 4 * 4);
  const int64_t tile_max = std::max<int64_t>(3, kRowTileBytes / (K * int64_t(sizeof(float))) / 3 * 3);
  const int64_t tiles = (M + tile_max - 1) / tile_max;
  const int64_t tile = ((M + tiles - 1) / tiles + 2) / 3 * 3;  // equal tiles: the last one is not a sliver
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(n1, b0 + block);
    if constexpr (kBf16) {
      if (widen) {
        thread_local std::vector<float> scratch;
        scratch.resize(static_cast<size_t>((b1 - b0) * K));
        widen_avx2(w + b0 * K, scratch.data(), (b1 - b0) * K);
        // The block's rows are rows [0, b1 - b0) of the scratch: shift y by b0 columns to match.
        block_avx2(x, scratch.data(), y + b0, M, N, K, 0, b1 - b0, tile);
        continue;
      }
    }
    block_avx2(x, w, y, M, N, K, b0, b1, tile);
  }
}

bool HaveAvx2Fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         std::getenv("BLOCKSPEC_JAX_KERNEL_GENERIC") == nullptr;
  return ok;
}
#endif

template <typename WT>
void rows(const float* x, const WT* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
#ifdef BSJ_X86
  if (HaveAvx2Fma()) return rows_avx2(x, w, y, M, N, K, n0, n1);
#endif
  rows_generic(x, w, y, M, N, K, n0, n1);
}

// ---------------------------------------------------------------------------------------------------------------
// Work sharing over XLA's intra-op pool.

int ThreadCap() {
  static const int cap = [] {
    const char* env = std::getenv("BLOCKSPEC_JAX_KERNEL_THREADS");
    const int n = env ? std::atoi(env) : 0;
    return n >= 1 ? n : 1 << 20;
  }();
  return cap;
}

struct Shared {
  std::atomic<int64_t> next{0};      // next chunk to claim
  std::atomic<int64_t> finished{0};  // chunks done
  int64_t chunks = 0;
  std::function<void(int64_t)> run;  // runs one chunk
};

// Claims and runs chunks until none is left.
inline void Drain(Shared& s) {
  for (int64_t c = s.next.fetch_add(1, std::memory_order_relaxed); c < s.chunks;
       c = s.next.fetch_add(1, std::memory_order_relaxed)) {
    s.run(c);
    s.finished.fetch_add(1, std::memory_order_acq_rel);
  }
}

template <typename WT>
void Linear(ffi::ThreadPool& pool, const float* x, const WT* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), ThreadCap());
  const int64_t quads = (N + 3) / 4;
  // Chunks of at least 16 quads (64 rows), up to 4 per thread for balance when a thread starts late.
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, quads / 16), 4 * threads);
  if (threads <= 1 || chunks <= 1) return rows(x, w, y, M, N, K, 0, N);
  auto shared = std::make_shared<Shared>();
  shared->chunks = chunks;
  shared->run = [=](int64_t c) {
    const int64_t q0 = quads * c / chunks, q1 = quads * (c + 1) / chunks;
    rows(x, w, y, M, N, K, std::min(N, q0 * 4), std::min(N, q1 * 4));
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([shared] { Drain(*shared); });
  Drain(*shared);
  while (shared->finished.load(std::memory_order_acquire) != chunks) {
#ifdef BSJ_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }
}

template <ffi::DataType WDT>
ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WDT> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: expected x [M, K] and w [N, K]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: expected y [M, N]");
  }
  Linear(pool, x.typed_data(), w.typed_data(), y->typed_data(), M, N, K);
  return ffi::Error::Success();
}

// One layer of a stacked weight w [L, N, K] (a decoder whose layers run in a loop): the layer's [N, K] block is
// read in place, so the loop never copies a layer's weights before streaming them.
template <ffi::DataType WDT>
ffi::Error LinearStackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WDT> w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2] || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: expected x [M, K], w [L, N, K] and a scalar layer");
  }
  const int64_t M = xd[0], K = xd[1], L = wd[0], N = wd[1];
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: expected y [M, N]");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: layer index out of range");
  }
  Linear(pool, x.typed_data(), w.typed_data() + l * N * K, y->typed_data(), M, N, K);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsjLinearStackedF32, LinearStackedImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsjLinearStackedBF16, LinearStackedImpl<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsjLinearF32, LinearImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsjLinearBF16, LinearImpl<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

