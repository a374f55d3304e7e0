// kvattn's float32 dot for XLA:CPU: out[m, n] = sum_k a[m, k] * w[k, n], over weights laid out in panels,
// stored in float32 (`f32_dot`) or bfloat16 (`bf16_dot`).
//
// Weights `(N / 16, K, 16)`: panel t holds outputs 16t..16t+15 for every k, so a panel is one contiguous
// stream (`kvattn.math.quant.panel` lays them out). XLA:CPU's dot reads a `(K, N)` kernel row by row; a step's
// few rows are then a strided read, well below the bandwidth the same bytes stream at in panels. Three
// panels are read side by side, so each k is 3 vector loads and 8 x 3 fused multiply-adds into 24
// accumulators: the same kernel serves a step (bandwidth bound) and a prefill's rows (compute bound, and
// there too faster than XLA's dot).
//
// bfloat16 panels are half the bytes to stream. A bfloat16 is the upper half of the float32 of the same
// value, so each weight is widened exactly in register (a zero-extension and a shift) and the sums are
// the float32 dot's over those values, rows kept in float32: AVX512-BF16's `vdpbf16ps` would round the
// rows to bfloat16 too.
//
// Each output is one float32 sum over k in order, whatever M is and whichever rows share a block, so a
// row's result does not depend on the rows beside it. A block's eight rows are read where they are
// (copying them k-major first was slower). Work is split over XLA's
// intra-op thread pool by panels; the handler returns a future completed by the last part.
//
// Without AVX-512 (`kvattn::Avx512`), the same dot runs on AVX2 and FMA: a panel row is two 256-bit
// vectors, and with 16 registers a block is up to six rows, side by side with fewer panels. Each output is
// the same in-order sum of fused multiply-adds, so both bodies give the same bits.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvattn::Failed;

namespace {

constexpr int64_t kLanes = 16;  // float32 lanes of a 512-bit vector: a panel's width
constexpr int64_t kAhead = 4096;  // bytes read ahead of a panel's stream

#ifdef KVATTN_X86

// 16 weights of a panel row as float32.
KVATTN_AVX512 inline __m512 Widen(const float* at) { return _mm512_loadu_ps(at); }
KVATTN_AVX512 inline __m512 Widen(const uint16_t* at) {  // bfloat16 bits: float32's upper half
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// Rows [0, MR) of `a` (row stride K) by panels [t, t + NT) over k in [k0, k1), into out (row stride ldo): sums
// start from zero at k0 = 0, else from what `out` holds (a tile's sums carried to the next).
template <int MR, int NT, typename W>
KVATTN_AVX512 void Panel(const float* a, int64_t K, const W* w, int64_t t, float* out, int64_t ldo, int64_t k0,
                         int64_t k1) {
  const W* panels[NT];
  __m512 acc[MR][NT];
  for (int j = 0; j < NT; ++j) {
    panels[j] = w + (t + j) * K * kLanes;
    for (int i = 0; i < MR; ++i) {
      acc[i][j] = k0 ? _mm512_loadu_ps(out + i * ldo + (t + j) * kLanes) : _mm512_setzero_ps();
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m512 b[NT];
    for (int j = 0; j < NT; ++j) {
      const W* at = panels[j] + k * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T0);
      b[j] = Widen(at);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * K + k]);
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(x, b[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NT; ++j) _mm512_storeu_ps(out + i * ldo + (t + j) * kLanes, acc[i][j]);
  }
}

// The AVX-512 body: blocks of up to eight rows, three panels side by side.
struct Avx512Body {
  static constexpr int64_t kRows = 8;
  static constexpr int64_t kTiledBlocks = 0;  // tiles not measured with AVX-512: its blocks read whole panels
  template <int MR, typename W>
  static void Block(const float* a, int64_t K, const W* w, float* out, int64_t ldo, int64_t t0, int64_t t1,
                    int64_t k0, int64_t k1) {
    constexpr int kSideBySide = 3;  // 32 registers: MR * 3 accumulators, 3 panels' vectors, a broadcast
    int64_t t = t0;
    for (; t + kSideBySide <= t1; t += kSideBySide) Panel<MR, kSideBySide>(a, K, w, t, out, ldo, k0, k1);
    for (; t < t1; ++t) Panel<MR, 1>(a, K, w, t, out, ldo, k0, k1);
  }
};

// ---- AVX2 and FMA: a panel row as two halves of 8 lanes.

KVATTN_AVX2 inline void Widen2(const float* at, __m256& low, __m256& high) {
  low = _mm256_loadu_ps(at);
  high = _mm256_loadu_ps(at + 8);
}
KVATTN_AVX2 inline void Widen2(const uint16_t* at, __m256& low, __m256& high) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(halves)), 16));
  high = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(halves, 1)), 16));
}

template <int MR, int NT, typename W>
KVATTN_AVX2 void Panel2(const float* a, int64_t K, const W* w, int64_t t, float* out, int64_t ldo, int64_t k0,
                        int64_t k1) {
  const W* panels[NT];
  __m256 acc[MR][NT][2];
  for (int j = 0; j < NT; ++j) {
    panels[j] = w + (t + j) * K * kLanes;
    for (int i = 0; i < MR; ++i) {
      const float* sums = out + i * ldo + (t + j) * kLanes;
      acc[i][j][0] = k0 ? _mm256_loadu_ps(sums) : _mm256_setzero_ps();
      acc[i][j][1] = k0 ? _mm256_loadu_ps(sums + 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m256 b[NT][2];
    for (int j = 0; j < NT; ++j) {
      const W* at = panels[j] + k * kLanes;
      _mm_prefetch(reinterpret_cast<const char*>(at) + kAhead, _MM_HINT_T0);
      Widen2(at, b[j][0], b[j][1]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_set1_ps(a[i * K + k]);
      for (int j = 0; j < NT; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(x, b[j][0], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(x, b[j][1], acc[i][j][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NT; ++j) {
      _mm256_storeu_ps(out + i * ldo + (t + j) * kLanes, acc[i][j][0]);
      _mm256_storeu_ps(out + i * ldo + (t + j) * kLanes + 8, acc[i][j][1]);
    }
  }
}

// The AVX2 body: blocks of up to six rows. 16 registers: MR * NT * 2 accumulators, NT * 2 weight vectors
// and a broadcast; six rows keep twelve chains of multiply-adds going, enough to hide their latency.
struct Avx2Body {
  static constexpr int64_t kRows = 6;
  static constexpr int64_t kTiledBlocks = 4;  // 7 to 24 rows
  template <int MR, typename W>
  static void Block(const float* a, int64_t K, const W* w, float* out, int64_t ldo, int64_t t0, int64_t t1,
                    int64_t k0, int64_t k1) {
    constexpr int kSideBySide = MR == 1 ? 3 : MR == 2 ? 2 : 1;
    int64_t t = t0;
    for (; t + kSideBySide <= t1; t += kSideBySide) Panel2<MR, kSideBySide>(a, K, w, t, out, ldo, k0, k1);
    for (; t < t1; ++t) Panel2<MR, 1>(a, K, w, t, out, ldo, k0, k1);
  }
};

// A block of `rows` (at most Body::kRows) by panels [t0, t1) over k in [k0, k1), through the body's block of
// that many rows.
template <typename Body, int MR = Body::kRows, typename W>
void Rows(int64_t rows, const float* a, int64_t K, const W* w, float* out, int64_t ldo, int64_t t0, int64_t t1,
          int64_t k0, int64_t k1) {
  if constexpr (MR > 1) {
    if (rows < MR) return Rows<Body, MR - 1>(rows, a, K, w, out, ldo, t0, t1, k0, k1);
  }
  Body::template Block<MR>(a, K, w, out, ldo, t0, t1, k0, k1);
}

// Every block of rows by panels [t0, t1), the rows split into blocks of at most Body::kRows, as even as they
// go: the blocks of a panel group follow each other, so the group's panels stay in cache while every row reads
// them. A few blocks over float32 panels (up to Body::kTiledBlocks: a decode step's batch) multiply a group in
// less time than memory takes to deliver it, and read it again from L2 or beyond; they take the group kTileK
// values of k at a time instead, each block's sums stored in `out` and taken up again at the next tile (the same
// in-order sums), so the first block reads a tile from memory and the others from L1. That first block is the
// rest of the rows past full blocks (8 rows on AVX2 are 2 + 6): a short block reads panels side by side, which
// memory delivers faster than one panel at a time. More blocks, and bfloat16 panels (widened in register), are
// bound by their arithmetic, which the carried sums would slow.
template <typename Body, typename W>
void Part(const float* a, int64_t M, int64_t K, const W* w, float* out, int64_t N, int64_t t0, int64_t t1) {
  constexpr int64_t kGroup = 12;  // panels read by every block before the next ones: 48 KB per 64 k
  constexpr int64_t kTileK = 64;
  const int64_t blocks = (M + Body::kRows - 1) / Body::kRows;
  const bool tiled = std::is_same_v<W, float> && blocks > 1 && blocks <= Body::kTiledBlocks;
  const int64_t tile = tiled ? kTileK : std::max<int64_t>(K, 1);
  const int64_t tiles = std::max<int64_t>(1, (K + tile - 1) / tile);  // one where K is 0: its sums are zeros
  const int64_t rest = M - Body::kRows * (blocks - 1);  // a tiled first block's rows: the rest, then full blocks
  for (int64_t g = t0; g < t1; g += kGroup) {
    const int64_t g1 = std::min(t1, g + kGroup);
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t k0 = i * tile, k1 = std::min(K, k0 + tile);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m = tiled ? (b ? rest + (b - 1) * Body::kRows : 0) : M * b / blocks;
        const int64_t m1 = tiled ? rest + b * Body::kRows : M * (b + 1) / blocks;
        Rows<Body>(m1 - m, a + m * K, K, w, out + m * N, N, g, g1, k0, k1);
      }
    }
  }
}

// The rows (..., K) by panels (N / 16, K, 16) of weights W, into (..., N); `name` for errors.
template <ffi::DataType T, typename W>
ffi::Future Dot(const char* name, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<T, 3> w,
                ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = w.dimensions();
  const auto shape = a.dimensions();
  const int64_t panels = dims[0], K = dims[1], N = panels * kLanes;
  int64_t M = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) M *= shape[d];
  if (dims[2] != kLanes || shape.size() == 0 || shape.back() != K || out->element_count() != M * N) {
    return Failed(name);
  }
  float* result = out->typed_data();
  const float* rows = a.typed_data();
  const W* weights = reinterpret_cast<const W*>(w.untyped_data());
  const bool wide = kvattn::Avx512();
  return kvattn::Split(pool, panels, panels / 3, [=](int64_t first, int64_t last) {
    if (wide) {
      Part<Avx512Body>(rows, M, K, weights, result, N, first, last);
    } else {
      Part<Avx2Body>(rows, M, K, weights, result, N, first, last);
    }
  });
}

ffi::Future F32Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32, 3> w,
                   ffi::ResultBuffer<ffi::F32> out) {
  return Dot<ffi::F32, float>(
      "kvattn's float32 dot: rows (..., K) and float32 panels (N / 16, K, 16) into (..., N) expected", pool, a,
      w, out);
}

ffi::Future Bf16Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::BF16, 3> w,
                    ffi::ResultBuffer<ffi::F32> out) {
  return Dot<ffi::BF16, uint16_t>(
      "kvattn's bfloat16 dot: rows (..., K) and bfloat16 panels (N / 16, K, 16) into (..., N) expected", pool,
      a, w, out);
}

KVATTN_KERNEL(f32_dot, F32Dot);
KVATTN_KERNEL(bf16_dot, Bf16Dot);

#endif  // KVATTN_X86

}  // namespace
