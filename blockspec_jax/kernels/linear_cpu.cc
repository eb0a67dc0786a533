// Linear layer for CPU decoding: y[m, n] = sum_k x[m, k] * w[n, k], for any number of rows M.
//
//   x  float32 [M, K]   activations (M = batch rows x tokens per row: B for a decode step, B*(γ+1) for a verify pass)
//   w  [N, K] weights in (out, in) layout, streamed from memory once per call: float32, bfloat16, or a block-quantized
//      GGUF tensor in blockspec_jax.models.quant's layout (codes [N, K] or nibbles [N, K/2], scales [N, K/group],
//      offsets [N, K/group] for the types with a minimum)
//   y  float32 [M, N]
//
// Why: at decode time a linear layer reads N*K weights to do M*N*K multiply-adds. A general GEMM (Eigen, oneDNN,
// OpenBLAS) packs the weight panel first and costs 1.5-3x a matrix-vector product already at M = 2..5 on a 2-core
// AVX2 machine, which is exactly the verify pass of speculative decoding. This kernel streams each weight row once and
// applies it to the activation rows while it is in registers, so a pass over γ+1 tokens costs about what a
// single-token step costs as long as the FMA units keep up with memory (M <= ~16 on AVX2). Wider passes (large
// batches) are compute-bound: rows and weight rows are then tiled in L2-sized blocks (rows_avx2). Quantized weights
// are read as they are stored (0.56-1.25 bytes per weight instead of 4) and dequantized in registers.
//
// Determinism: every y[m, n] is summed in one fixed order (8 lanes over k in steps of 8, a fixed horizontal
// reduction, then the k tail) that does not depend on M, on the blocking of m and n, or on the thread split. So a
// row's logits are bit-identical whether it is computed alone (autoregressive step), inside a multi-token pass, or
// next to any number of other rows.
//
// Weight row sources: the micro-kernels are templates over a "source" of weight rows (F32Src, BF16Src, QuantSrc<...>
// for the GGUF types) that only turns stored bytes into float32 weights, 8 (AVX2, one row) or 16 (AVX-512, 8 of each
// of two rows) at a time. The sums are written once, in the micro-kernels, for every source: lane j of an output's
// accumulator adds w[k] * x[k] for k = j, j + 8, j + 16, ... in that order with one fused multiply-add each, then
// hsum and the scalar tail. A source yields exactly the float32 weight that blockspec_jax.models.quant.dequantize
// gives (scale * float(code - zero_point) [+ offset]: the product is exact, so a fused multiply-add of it with the
// offset rounds once, like the separate add), so a quantized layer is bit-identical to the float32 kernel applied to
// its dequantized weights, on every path (scalar, AVX2, AVX-512). The AVX-512 micro-kernel keeps the 8-lane order: a
// 16-lane register holds the 8 lanes of two weight rows side by side (the activations broadcast to both halves), so
// each half is exactly the AVX2 accumulator of its row, reduced by the same hsum.
//
// Threads: the call runs on XLA's own intra-op thread pool (the FFI ThreadPool context), so it never competes with
// a second set of threads for the cores. N is cut into chunks (multiples of 4 rows); the calling thread and the
// tasks it schedules claim chunks from one atomic counter, so the caller finishes the work alone if every pool
// thread is busy (no deadlock when XLA runs several custom calls at once), and waits only for chunks another thread
// has already started. BLOCKSPEC_JAX_KERNEL_THREADS caps the threads used (default: XLA's pool size).
// BLOCKSPEC_JAX_KERNEL_GENERIC forces the portable loop, BLOCKSPEC_JAX_KERNEL_NO_AVX512 the AVX2 one (tests: every
// path gives the same bits).

#include <algorithm>
#include <atomic>
#include <cmath>
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
#define BSJ_AVX2 "avx2,fma,f16c"
#define BSJ_AVX512 "avx512f,avx2,fma,f16c"
#endif

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Weight row sources. Each has:
//   kChunk                     weights one vector step takes from a row (a multiple of 8); K % kChunk are the tail
//   Row row(n)                 where row n starts
//   static float at(Row, k)    one weight as float32 (the portable path and the k tail)
//   int64_t row_bytes()        bytes streamed per row (for cache blocking)
// and, on x86, chunk8(src, Row, k, __m256[kChunk / 8]) (AVX2: weights k .. k + kChunk of one row, 8 per register)
// and chunk16(src, Row a, Row b, k, __m512[kChunk / 8]) (AVX-512: lanes 0-7 row a, lanes 8-15 row b).

struct F16 {  // an IEEE half's bits (the legacy GGUF types' scales)
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(F16 h) {
  // Exact for every half, subnormals included (portable; the vector paths use F16C, also exact).
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1Fu,
                 mant = h.bits & 0x3FFu;
  if (exp == 0) {
    const float mag = std::ldexp(static_cast<float>(mant), -24);  // mant < 2^10: exact
    return sign ? -mag : mag;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct F32Src {
  static constexpr int kChunk = 8;
  using Row = const float*;
  const float* w;
  int64_t K;
  Row row(int64_t n) const { return w + n * K; }
  int64_t row_bytes() const { return K * int64_t(sizeof(float)); }
  static float at(Row r, int64_t k) { return r[k]; }
};

struct BF16Src {
  static constexpr int kChunk = 8;
  using Row = const uint16_t*;
  const uint16_t* w;
  int64_t K;
  Row row(int64_t n) const { return w + n * K; }
  int64_t row_bytes() const { return K * int64_t(sizeof(uint16_t)); }
  static float at(Row r, int64_t k) {
    uint32_t bits = static_cast<uint32_t>(r[k]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
};

// A GGUF type in blockspec_jax.models.quant's layout: codes (two 4-bit codes per byte, kNibble: byte j of each run of
// 16 holds weight j of its group of 32 in the low nibble and weight 16 + j in the high one; or one signed / unsigned
// byte per weight), one scale S (float32, or F16) per group of G weights, an offset per group when OFF, and a zero
// point ZP subtracted from the code. Weight = scale * float(code - ZP) [+ offset], as quant.dequantize computes it.
enum class Code { kNibble, kInt8, kUint8 };

template <Code C, typename S, int G, int ZP, bool OFF>
struct QuantSrc {
  static constexpr int kChunk = 32;  // K is a whole number of 32-weight blocks: no tail
  static constexpr int64_t kCodeDiv = C == Code::kNibble ? 2 : 1;
  static constexpr int64_t kGroup = G;
  struct Row {
    const uint8_t* c;
    const S* s;
    const S* o;
  };
  const uint8_t* codes;
  const S* scale;
  const S* offset;  // ignored unless OFF
  int64_t K;
  Row row(int64_t n) const {
    const int64_t groups = K / G;
    return {codes + n * (K / kCodeDiv), scale + n * groups, OFF ? offset + n * groups : nullptr};
  }
  int64_t row_bytes() const { return K / kCodeDiv + (K / G) * int64_t(sizeof(S)) * (OFF ? 2 : 1); }
  static float at(const Row& r, int64_t k) {
    int code;
    if constexpr (C == Code::kNibble) {
      const uint8_t b = r.c[k / 32 * 16 + k % 16];
      code = k % 32 < 16 ? (b & 0x0F) : (b >> 4);
    } else if constexpr (C == Code::kInt8) {
      code = static_cast<int8_t>(r.c[k]);
    } else {
      code = r.c[k];
    }
    const float q = static_cast<float>(code - ZP), s = to_float(r.s[k / G]);
    if constexpr (OFF) {
      return std::fma(s, q, to_float(r.o[k / G]));  // s * q is exact: one rounding, as in s * q + offset
    } else {
      return s * q;
    }
  }
};

using Q4_0Src = QuantSrc<Code::kNibble, F16, 32, 8, false>;
using Q4_1Src = QuantSrc<Code::kNibble, F16, 32, 0, true>;
using Q5_0Src = QuantSrc<Code::kInt8, F16, 32, 0, false>;  // also Q8_0: the same layout, wider codes
using Q5_1Src = QuantSrc<Code::kUint8, F16, 32, 0, true>;
using Q4_KSrc = QuantSrc<Code::kNibble, float, 32, 0, true>;
using Q5_KSrc = QuantSrc<Code::kUint8, float, 32, 0, true>;
using Q6_KSrc = QuantSrc<Code::kInt8, float, 16, 0, false>;

template <typename Src>
constexpr bool kIsQuant = !std::is_same<Src, F32Src>::value && !std::is_same<Src, BF16Src>::value;

// The same source with float32 scales (and offsets): the vector paths widen the F16 ones a block of rows at a time
// (exactly) into scratch, so their micro-kernels broadcast a float from memory instead of converting per group.
template <typename Src>
struct WithF32Scales {
  static constexpr bool kConverts = false;
};
template <Code C, int G, int ZP, bool OFF>
struct WithF32Scales<QuantSrc<C, F16, G, ZP, OFF>> {
  static constexpr bool kConverts = true;
  using type = QuantSrc<C, float, G, ZP, OFF>;
};

// ---------------------------------------------------------------------------------------------------------------
// Portable path: the same summation order as the vector paths (8 partial sums over k mod 8, pairwise reduction, tail).

template <typename Src>
void rows_generic(const float* x, const Src& src, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                  int64_t n1) {
  const int64_t k8 = K - K % 8;
  std::vector<float> wn(static_cast<size_t>(K));  // the row's weights, exactly as at() gives them
  for (int64_t n = n0; n < n1; ++n) {
    const typename Src::Row r = src.row(n);
    for (int64_t k = 0; k < K; ++k) wn[k] = Src::at(r, k);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < k8; k += 8) {
        for (int j = 0; j < 8; ++j) lane[j] = std::fma(wn[k + j], xm[k + j], lane[j]);
      }
      // Reduction order of the vector paths: (0+4, 1+5, 2+6, 3+7), then (a+c, b+d), then (e+f).
      float a = lane[0] + lane[4], b = lane[1] + lane[5], c = lane[2] + lane[6], d = lane[3] + lane[7];
      float e = a + c, f = b + d;
      float acc = e + f;
      for (int64_t k = k8; k < K; ++k) acc = std::fma(wn[k], xm[k], acc);
      y[m * N + n] = acc;
    }
  }
}

#ifdef BSJ_X86
// ---------------------------------------------------------------------------------------------------------------
// AVX2 + FMA sources.

__attribute__((target(BSJ_AVX2))) inline void chunk8(const F32Src&, F32Src::Row r, int64_t k, __m256* out) {
  out[0] = _mm256_loadu_ps(r + k);
}
__attribute__((target(BSJ_AVX2))) inline void chunk8(const BF16Src&, BF16Src::Row r, int64_t k, __m256* out) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + k));
  out[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target(BSJ_AVX2))) inline float scalar_of(const float* p) { return *p; }
__attribute__((target(BSJ_AVX2))) inline float scalar_of(const F16* p) { return _cvtsh_ss(p->bits); }

template <Code C, typename S, int G, int ZP, bool OFF>
__attribute__((target(BSJ_AVX2))) inline void chunk8(const QuantSrc<C, S, G, ZP, OFF>&,
                                                     const typename QuantSrc<C, S, G, ZP, OFF>::Row& r, int64_t k,
                                                     __m256* out) {
  __m256i q[4];
  if constexpr (C == Code::kNibble) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.c + k / 2));
    const __m256i z0 = _mm256_cvtepu8_epi32(b), z1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b));
    const __m256i low = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_and_si256(z0, low);    // weights 0-7: low nibbles of bytes 0-7
    q[1] = _mm256_and_si256(z1, low);    // 8-15: low nibbles of bytes 8-15
    q[2] = _mm256_srli_epi32(z0, 4);     // 16-23: high nibbles of bytes 0-7
    q[3] = _mm256_srli_epi32(z1, 4);     // 24-31: high nibbles of bytes 8-15
  } else {
    for (int s = 0; s < 4; ++s) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.c + k + 8 * s));
      q[s] = C == Code::kInt8 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    }
  }
  const int64_t g0 = k / G;
  for (int s = 0; s < 4; ++s) {
    if constexpr (ZP != 0) q[s] = _mm256_sub_epi32(q[s], _mm256_set1_epi32(ZP));
    const int64_t g = g0 + 8 * s / G;
    const __m256 f = _mm256_cvtepi32_ps(q[s]), sc = _mm256_set1_ps(scalar_of(r.s + g));
    if constexpr (OFF) {
      out[s] = _mm256_fmadd_ps(sc, f, _mm256_set1_ps(scalar_of(r.o + g)));  // sc * f exact: as sc * f + offset
    } else {
      out[s] = _mm256_mul_ps(sc, f);
    }
  }
}

__attribute__((target(BSJ_AVX2))) void halves_to_floats(const F16* in, float* out, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < count; ++i) out[i] = _cvtsh_ss(in[i].bits);
}

// Rows [b0, b1) of an F16-scaled source as a source of b1 - b0 rows (row 0 = row b0) with float32 scales and offsets
// held in s and o (exact conversions: the same weights).
template <Code C, int G, int ZP, bool OFF>
__attribute__((target(BSJ_AVX2))) QuantSrc<C, float, G, ZP, OFF> f32_scales(const QuantSrc<C, F16, G, ZP, OFF>& src,
                                                                             int64_t b0, int64_t b1,
                                                                             std::vector<float>& s,
                                                                             std::vector<float>& o) {
  const int64_t groups = src.K / G, count = (b1 - b0) * groups;
  s.resize(static_cast<size_t>(count));
  halves_to_floats(src.scale + b0 * groups, s.data(), count);
  if constexpr (OFF) {
    o.resize(static_cast<size_t>(count));
    halves_to_floats(src.offset + b0 * groups, o.data(), count);
  }
  using Out = QuantSrc<C, float, G, ZP, OFF>;
  return Out{src.codes + b0 * (src.K / Out::kCodeDiv), s.data(), OFF ? o.data() : s.data(), src.K};
}

// Software prefetch of the weights `ahead` rows further on, at the same k (the rows the next micro-kernel call of this
// pass over k streams), one cache line per 64 bytes of each stream: with a matrix streamed from DRAM (an output head)
// the hardware prefetchers alone left the quantized loop latency-bound at about half the float32 loop's bytes/s.
// Prefetches never fault, so reaching past the last row is harmless; they change no result.
__attribute__((target(BSJ_AVX2))) inline void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
__attribute__((target(BSJ_AVX2))) inline void prefetch_ahead(const F32Src& src, F32Src::Row r, int64_t k,
                                                             int64_t ahead) {
  if ((k & 15) == 0) prefetch_line(r + k + ahead * src.K);
}
__attribute__((target(BSJ_AVX2))) inline void prefetch_ahead(const BF16Src& src, BF16Src::Row r, int64_t k,
                                                             int64_t ahead) {
  if ((k & 31) == 0) prefetch_line(r + k + ahead * src.K);
}
template <Code C, typename S, int G, int ZP, bool OFF>
__attribute__((target(BSJ_AVX2))) inline void prefetch_ahead(const QuantSrc<C, S, G, ZP, OFF>& src,
                                                             const typename QuantSrc<C, S, G, ZP, OFF>::Row& r,
                                                             int64_t k, int64_t ahead) {
  using Src = QuantSrc<C, S, G, ZP, OFF>;
  const int64_t at = k / Src::kCodeDiv, g = k / G, groups = src.K / G;
  if ((at & 63) == 0) prefetch_line(r.c + at + ahead * (src.K / Src::kCodeDiv));
  if ((g & (64 / int64_t(sizeof(S)) - 1)) == 0) {
    prefetch_line(r.s + g + ahead * groups);
    if constexpr (OFF) prefetch_line(r.o + g + ahead * groups);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX2 + FMA micro-kernel. It applies NR weight rows to MR activation rows per pass over k, holding NR*MR
// accumulators; the activation operand of each FMA comes straight from memory (L1/L2 resident).

__attribute__((target(BSJ_AVX2))) inline float hsum(__m256 v) {
  // (0+4, 1+5, 2+6, 3+7) -> (a+c, b+d) -> (e+f): matches rows_generic.
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                    // a b c d
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));    // a+c b+d . .
  __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));  // (a+c)+(b+d)
  return _mm_cvtss_f32(u);
}

// One output from its 8-lane accumulator: the fixed reduction, then the k tail [kv, K) in order. Every path ends here.
template <typename Src>
__attribute__((target(BSJ_AVX2))) inline float finish(__m256 acc, const typename Src::Row& r, const float* x,
                                                      int64_t kv, int64_t K) {
  float s = hsum(acc);
  for (int64_t k = kv; k < K; ++k) s = std::fma(Src::at(r, k), x[k], s);
  return s;
}

template <int MR, int NR, typename Src>
__attribute__((target(BSJ_AVX2))) inline void micro(const float* x, const Src& src, float* y, int64_t N, int64_t K,
                                                    int64_t m0, int64_t n0) {
  constexpr int S = Src::kChunk / 8;
  const int64_t kv = K - K % Src::kChunk;
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  typename Src::Row wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = src.row(n0 + j);
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * K;
  for (int64_t k = 0; k < kv; k += Src::kChunk) {
    __m256 wv[NR][S];
    for (int j = 0; j < NR; ++j) {
      prefetch_ahead(src, wr[j], k, NR);
      chunk8(src, wr[j], k, wv[j]);
    }
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < MR; ++i) {
        __m256 xv = _mm256_loadu_ps(xr[i] + k + 8 * s);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j][s], xv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) y[(m0 + i) * N + n0 + j] = finish<Src>(acc[i][j], wr[j], xr[i], kv, K);
  }
}

template <int NR, typename Src>
__attribute__((target(BSJ_AVX2))) void rows_avx2_nr(const float* x, const Src& src, float* y, int64_t M, int64_t N,
                                                     int64_t K, int64_t n) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) micro<3, NR>(x, src, y, N, K, m, n);
  if (M - m == 2) micro<2, NR>(x, src, y, N, K, m, n);
  if (M - m == 1) micro<1, NR>(x, src, y, N, K, m, n);
}

// Cache blocking for any M: weight rows [n0, n1) are taken in blocks of about kWeightBlockBytes (L2 resident) and,
// inside a block, activation rows in equal tiles of at most about kRowTileBytes (a multiple of 3 rows, L2 resident),
// so a wide pass (many rows) re-reads both from L2 instead of streaming all of x from memory for every 4 weight rows.
// bfloat16 and quantized weights applied to more than kWidenRows rows are widened to float32 once per block (into a
// per-thread scratch buffer) instead of once per 3 (AVX-512: 6) rows. With M <= one tile this is the plain loop.
// Blocking, tiling and widening (exact) only reorder whole outputs, never the sum of one, so they change no bits.
constexpr int64_t kWeightBlockBytes = 128 << 10;
constexpr int64_t kRowTileBytes = 128 << 10;
constexpr int64_t kWidenRows = 6;

template <typename Src>
__attribute__((target(BSJ_AVX2))) void block_avx2(const float* x, const Src& src, float* y, int64_t M, int64_t N,
                                                  int64_t K, int64_t n0, int64_t n1, int64_t tile) {
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const int64_t mt = std::min(tile, M - m0);
    const float* xt = x + m0 * K;
    float* yt = y + m0 * N;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_avx2_nr<4>(xt, src, yt, mt, N, K, n);
    for (; n < n1; ++n) rows_avx2_nr<1>(xt, src, yt, mt, N, K, n);
  }
}

// Rows [n0, n1) of src as float32 into out [(n1 - n0), K]: the very weights the micro-kernels use.
template <typename Src>
__attribute__((target(BSJ_AVX2))) void widen_avx2(const Src& src, int64_t n0, int64_t n1, int64_t K, float* out) {
  constexpr int S = Src::kChunk / 8;
  const int64_t kv = K - K % Src::kChunk;
  for (int64_t n = n0; n < n1; ++n, out += K) {
    const typename Src::Row r = src.row(n);
    for (int64_t k = 0; k < kv; k += Src::kChunk) {
      __m256 wv[S];
      chunk8(src, r, k, wv);
      for (int s = 0; s < S; ++s) _mm256_storeu_ps(out + k + 8 * s, wv[s]);
    }
    for (int64_t k = kv; k < K; ++k) out[k] = Src::at(r, k);
  }
}

// Row tile: at most about kRowTileBytes of x, a multiple of `mult` rows, the tiles of M equal (the last one is not a
// sliver).
inline int64_t row_tile(int64_t M, int64_t K, int64_t mult) {
  const int64_t tile_max = std::max<int64_t>(mult, kRowTileBytes / (K * int64_t(sizeof(float))) / mult * mult);
  const int64_t tiles = (M + tile_max - 1) / tile_max;
  return ((M + tiles - 1) / tiles + mult - 1) / mult * mult;
}

// Widened blocks: each block of weight rows as float32 in a per-thread scratch buffer, then the float32 micro-kernels.
template <typename Src>
__attribute__((target(BSJ_AVX2))) void rows_widened(const float* x, const Src& src, float* y, int64_t M, int64_t N,
                                                    int64_t K, int64_t n0, int64_t n1) {
  const int64_t block = std::max<int64_t>(4, kWeightBlockBytes / (K * int64_t(sizeof(float))) / 4 * 4);
  const int64_t tile = row_tile(M, K, 3);
  thread_local std::vector<float> scratch;
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(n1, b0 + block);
    scratch.resize(static_cast<size_t>((b1 - b0) * K));
    widen_avx2(src, b0, b1, K, scratch.data());
    // The block's rows are rows [0, b1 - b0) of the scratch: shift y by b0 columns to match.
    block_avx2(x, F32Src{scratch.data(), K}, y + b0, M, N, K, 0, b1 - b0, tile);
  }
}

template <typename Src>
__attribute__((target(BSJ_AVX2))) void rows_avx2(const float* x, const Src& src, float* y, int64_t M, int64_t N,
                                                 int64_t K, int64_t n0, int64_t n1) {
  if (M <= 0) return;
  if constexpr (!std::is_same<Src, F32Src>::value) {
    if (M > kWidenRows) return rows_widened(x, src, y, M, N, K, n0, n1);
  }
  const int64_t block = std::max<int64_t>(4, kWeightBlockBytes / src.row_bytes() / 4 * 4);
  const int64_t tile = row_tile(M, K, 3);
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(n1, b0 + block);
    if constexpr (WithF32Scales<Src>::kConverts) {
      thread_local std::vector<float> s, o;
      // The block's rows are rows [0, b1 - b0) of the converted source: shift y by b0 columns to match.
      block_avx2(x, f32_scales(src, b0, b1, s, o), y + b0, M, N, K, 0, b1 - b0, tile);
    } else {
      block_avx2(x, src, y, M, N, K, b0, b1, tile);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX-512 (quantized sources): 16 lanes = the 8 lanes of weight row a (0-7) and of weight row b (8-15).

// Scale (offset) a in lanes 0-7, b in lanes 8-15. Sources with F16 scales reach the AVX-512 loop converted to float32
// (rows_avx512), so only float32 ones come here.
__attribute__((target(BSJ_AVX512))) inline __m512 pair_of(const float* a, const float* b) {
  return _mm512_mask_broadcastss_ps(_mm512_set1_ps(*a), 0xFF00, _mm_load_ss(b));
}

template <Code C, typename S, int G, int ZP, bool OFF>
__attribute__((target(BSJ_AVX512))) inline void chunk16(const QuantSrc<C, S, G, ZP, OFF>&,
                                                        const typename QuantSrc<C, S, G, ZP, OFF>::Row& a,
                                                        const typename QuantSrc<C, S, G, ZP, OFF>::Row& b, int64_t k,
                                                        __m512* out) {
  __m512i q[4];
  if constexpr (C == Code::kNibble) {
    const __m128i ba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.c + k / 2));
    const __m128i bb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.c + k / 2));
    const __m512i z0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ba, bb));  // bytes 0-7 of a | of b
    const __m512i z1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(ba, bb));  // bytes 8-15 of a | of b
    const __m512i low = _mm512_set1_epi32(0x0F);
    q[0] = _mm512_and_si512(z0, low);
    q[1] = _mm512_and_si512(z1, low);
    q[2] = _mm512_srli_epi32(z0, 4);
    q[3] = _mm512_srli_epi32(z1, 4);
  } else {
    for (int h = 0; h < 2; ++h) {
      const __m128i ba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.c + k + 16 * h));
      const __m128i bb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.c + k + 16 * h));
      const __m128i lo = _mm_unpacklo_epi64(ba, bb), hi = _mm_unpackhi_epi64(ba, bb);
      q[2 * h] = C == Code::kInt8 ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
      q[2 * h + 1] = C == Code::kInt8 ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
    }
  }
  const int64_t g0 = k / G;
  for (int s = 0; s < 4; ++s) {
    if constexpr (ZP != 0) q[s] = _mm512_sub_epi32(q[s], _mm512_set1_epi32(ZP));
    const int64_t g = g0 + 8 * s / G;
    const __m512 f = _mm512_cvtepi32_ps(q[s]), sc = pair_of(a.s + g, b.s + g);
    if constexpr (OFF) {
      out[s] = _mm512_fmadd_ps(sc, f, pair_of(a.o + g, b.o + g));
    } else {
      out[s] = _mm512_mul_ps(sc, f);
    }
  }
}

// MR activation rows x NP pairs of weight rows (n0 + 2p, n0 + 2p + 1). Lane j of each half adds the same products in
// the same order as the AVX2 micro-kernel's lane j, and each half is reduced by the same finish().
template <int MR, int NP, typename Src>
__attribute__((target(BSJ_AVX512))) inline void micro512(const float* x, const Src& src, float* y, int64_t N,
                                                         int64_t K, int64_t m0, int64_t n0) {
  constexpr int S = Src::kChunk / 8;
  const int64_t kv = K - K % Src::kChunk;
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
  typename Src::Row ra[NP], rb[NP];
  for (int p = 0; p < NP; ++p) ra[p] = src.row(n0 + 2 * p), rb[p] = src.row(n0 + 2 * p + 1);
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = x + (m0 + i) * K;
  for (int64_t k = 0; k < kv; k += Src::kChunk) {
    __m512 wv[NP][S];
    for (int p = 0; p < NP; ++p) {
      prefetch_ahead(src, ra[p], k, 2 * NP);
      prefetch_ahead(src, rb[p], k, 2 * NP);
      chunk16(src, ra[p], rb[p], k, wv[p]);
    }
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < MR; ++i) {
        const __m256 x8 = _mm256_loadu_ps(xr[i] + k + 8 * s);
        const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x8)));  // x8 | x8
        for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(wv[p][s], xv, acc[i][p]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int p = 0; p < NP; ++p) {
      const __m256 lo = _mm512_castps512_ps256(acc[i][p]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i][p]), 1));
      y[(m0 + i) * N + n0 + 2 * p] = finish<Src>(lo, ra[p], xr[i], kv, K);
      y[(m0 + i) * N + n0 + 2 * p + 1] = finish<Src>(hi, rb[p], xr[i], kv, K);
    }
  }
}

constexpr int kMR512 = 6;  // activation rows per AVX-512 pass: a verify pass of up to 6 tokens dequantizes once

template <int NP, typename Src>
__attribute__((target(BSJ_AVX512))) void rows512_np(const float* x, const Src& src, float* y, int64_t M, int64_t N,
                                                    int64_t K, int64_t n) {
  int64_t m = 0;
  for (; m + kMR512 <= M; m += kMR512) micro512<kMR512, NP>(x, src, y, N, K, m, n);
  switch (M - m) {
    case 5: micro512<5, NP>(x, src, y, N, K, m, n); break;
    case 4: micro512<4, NP>(x, src, y, N, K, m, n); break;
    case 3: micro512<3, NP>(x, src, y, N, K, m, n); break;
    case 2: micro512<2, NP>(x, src, y, N, K, m, n); break;
    case 1: micro512<1, NP>(x, src, y, N, K, m, n); break;
    default: break;
  }
}

template <typename Src>
__attribute__((target(BSJ_AVX512))) void block512(const float* x, const Src& src, float* y, int64_t M, int64_t N,
                                                  int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows512_np<2>(x, src, y, M, N, K, n);
  if (n + 2 <= n1) rows512_np<1>(x, src, y, M, N, K, n), n += 2;
  if (n < n1) rows_avx2_nr<1>(x, src, y, M, N, K, n);
}

template <typename Src>
__attribute__((target(BSJ_AVX512))) void rows_avx512(const float* x, const Src& src, float* y, int64_t M,
                                                     int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M <= 0) return;
  if (M > kMR512) return rows_widened(x, src, y, M, N, K, n0, n1);
  if constexpr (WithF32Scales<Src>::kConverts) {
    const int64_t block = std::max<int64_t>(4, kWeightBlockBytes / src.row_bytes() / 4 * 4);
    thread_local std::vector<float> s, o;
    for (int64_t b0 = n0; b0 < n1; b0 += block) {
      const int64_t b1 = std::min(n1, b0 + block);
      block512(x, f32_scales(src, b0, b1, s, o), y + b0, M, N, K, 0, b1 - b0);
    }
  } else {
    block512(x, src, y, M, N, K, n0, n1);
  }
}

bool HaveAvx2Fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c") && std::getenv("BLOCKSPEC_JAX_KERNEL_GENERIC") == nullptr;
  return ok;
}

bool HaveAvx512() {
  static const bool ok = HaveAvx2Fma() && __builtin_cpu_supports("avx512f") &&
                         std::getenv("BLOCKSPEC_JAX_KERNEL_NO_AVX512") == nullptr;
  return ok;
}
#endif

template <typename Src>
void rows(const float* x, const Src& src, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
#ifdef BSJ_X86
  if constexpr (kIsQuant<Src>) {
    if (HaveAvx512()) return rows_avx512(x, src, y, M, N, K, n0, n1);
  }
  if (HaveAvx2Fma()) return rows_avx2(x, src, y, M, N, K, n0, n1);
#endif
  rows_generic(x, src, y, M, N, K, n0, n1);
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

template <typename Src>
void Linear(ffi::ThreadPool& pool, const float* x, const Src& src, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), ThreadCap());
  const int64_t quads = (N + 3) / 4;
  // Chunks of at least 16 quads (64 rows), up to 4 per thread for balance when a thread starts late. Quantized rows
  // cost less, so their chunks are also at least about 256K weights: a small layer (attn_k) whose work takes less than
  // waking a pool thread (which then ramps up its 512-bit units) stays on the calling thread.
  const int64_t min_quads = kIsQuant<Src> ? std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(1, K)) : 16;
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, quads / min_quads), 4 * threads);
  if (threads <= 1 || chunks <= 1) return rows(x, src, y, M, N, K, 0, N);
  auto shared = std::make_shared<Shared>();
  shared->chunks = chunks;
  shared->run = [=](int64_t c) {
    const int64_t q0 = quads * c / chunks, q1 = quads * (c + 1) / chunks;
    rows(x, src, y, M, N, K, std::min(N, q0 * 4), std::min(N, q1 * 4));
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
auto SourceOf(const void* w, int64_t K) {
  if constexpr (WDT == ffi::F32) {
    return F32Src{static_cast<const float*>(w), K};
  } else {
    return BF16Src{static_cast<const uint16_t*>(w), K};
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
  Linear(pool, x.typed_data(), SourceOf<WDT>(w.untyped_data(), K), y->typed_data(), M, N, K);
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
  Linear(pool, x.typed_data(), SourceOf<WDT>(w.typed_data() + l * N * K, K), y->typed_data(), M, N, K);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// Quantized weights (blockspec_jax.models.quant.QuantizedTensor): codes [N, C], scale [N, G], offset [N, G] (any
// array for the types without one: it is not read), or the same with a leading layer axis [L, ...] and `layer`
// picking one in place. qtype indexes kQuantTypes (the order of kernels._QUANT_TYPES in Python).

struct QuantType {
  const char* name;
  int group;
  bool packed;
  ffi::DataType code, scale;
  bool offset;
};

constexpr QuantType kQuantTypes[] = {
    {"Q4_0", 32, true, ffi::U8, ffi::F16, false}, {"Q4_1", 32, true, ffi::U8, ffi::F16, true},
    {"Q5_0", 32, false, ffi::S8, ffi::F16, false}, {"Q5_1", 32, false, ffi::U8, ffi::F16, true},
    {"Q8_0", 32, false, ffi::S8, ffi::F16, false}, {"Q4_K", 32, true, ffi::U8, ffi::F32, true},
    {"Q5_K", 32, false, ffi::U8, ffi::F32, true}, {"Q6_K", 16, false, ffi::S8, ffi::F32, false},
};

template <typename Src>
void RunQuant(ffi::ThreadPool& pool, const float* x, const void* codes, const void* scale, const void* offset,
              float* y, int64_t M, int64_t N, int64_t K) {
  using S = typename std::remove_const<typename std::remove_pointer<decltype(Src::Row::s)>::type>::type;
  const Src src{static_cast<const uint8_t*>(codes), static_cast<const S*>(scale), static_cast<const S*>(offset), K};
  Linear(pool, x, src, y, M, N, K);
}

ffi::Error LinearQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes, ffi::AnyBuffer scale,
                           ffi::AnyBuffer offset, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                           int32_t qtype) {
  constexpr int kTypes = sizeof(kQuantTypes) / sizeof(kQuantTypes[0]);
  if (qtype < 0 || qtype >= kTypes) return ffi::Error::InvalidArgument("blockspec_jax linear: unknown quant type");
  const QuantType& t = kQuantTypes[qtype];
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  const size_t rank = cd.size();
  if (xd.size() != 2 || (rank != 2 && rank != 3) || sd.size() != rank || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: expected x [M, K], codes / scale [(L,) N, C / G] and "
                                       "a scalar layer");
  }
  const int64_t M = xd[0], K = xd[1], N = cd[rank - 2], L = rank == 3 ? cd[0] : 1;
  const int64_t C = t.packed ? K / 2 : K, G = K / t.group;
  bool ok = K % 32 == 0 && cd[rank - 1] == C && sd[rank - 2] == N && sd[rank - 1] == G &&
            codes.element_type() == t.code && scale.element_type() == t.scale && (rank == 2 || sd[0] == L);
  if (t.offset) {
    ok = ok && od.size() == rank && offset.element_type() == t.scale && od[rank - 2] == N && od[rank - 1] == G &&
         (rank == 2 || od[0] == L);
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string("blockspec_jax linear: the codes / scale / offset of a ") + t.name +
                                       " tensor do not match x [M, K] (K a multiple of 32)");
  }
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != M || yd[1] != N) {
    return ffi::Error::InvalidArgument("blockspec_jax linear: expected y [M, N]");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("blockspec_jax linear: layer index out of range");
  const int64_t scale_bytes = t.scale == ffi::F32 ? 4 : 2;
  const auto* c = static_cast<const uint8_t*>(codes.untyped_data()) + l * N * C;
  const auto* s = static_cast<const uint8_t*>(scale.untyped_data()) + l * N * G * scale_bytes;
  const auto* o = t.offset ? static_cast<const uint8_t*>(offset.untyped_data()) + l * N * G * scale_bytes : s;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  switch (qtype) {
    case 0: RunQuant<Q4_0Src>(pool, xp, c, s, o, yp, M, N, K); break;
    case 1: RunQuant<Q4_1Src>(pool, xp, c, s, o, yp, M, N, K); break;
    case 2: case 4: RunQuant<Q5_0Src>(pool, xp, c, s, o, yp, M, N, K); break;
    case 3: RunQuant<Q5_1Src>(pool, xp, c, s, o, yp, M, N, K); break;
    case 5: RunQuant<Q4_KSrc>(pool, xp, c, s, o, yp, M, N, K); break;
    case 6: RunQuant<Q5_KSrc>(pool, xp, c, s, o, yp, M, N, K); break;
    case 7: RunQuant<Q6_KSrc>(pool, xp, c, s, o, yp, M, N, K); break;
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(BsjLinearQuant, LinearQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype"));
