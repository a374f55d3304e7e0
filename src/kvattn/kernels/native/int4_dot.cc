// kvattn's 4-bit dot for XLA:CPU: out[m, n] = sum_g d[n, g] * (sum_{k in g} a[m, k] * q[n, k]), int8 rows by
// 4-bit weights with a bfloat16 scale per group of inputs (`kvattn.math.int4`).
//
// Weights: each block of 32 inputs 16 bytes, byte i holding q + 8 of input i in its low nibble and of input
// i + 16 in its high one (llama.cpp's Q4_0 order), in one of two layouts (`Rows`, `Tiles`): an output's
// blocks one after another, uint8 `(N, K / 2)` with bfloat16 scales `(N, K / group)`; or eight outputs'
// blocks side by side, uint8 `(N / 8, K / 32, 8, 16)` with scales `(N / 8, K / group, 8)`, which a pass
// over eight outputs reads as one stream (`kvattn.math.int4.tile`; about 1.6x faster than eight streams).
// Rows: int8 `(..., K)`, the rows `kvattn.kernels.dots` quantized.
//
// Eight outputs are worked on together. Their blocks are unpacked in register (a mask and a shift: u = q + 8
// in 0..15) and multiplied by a row's int8 values with `vpmaddubsw` (pairs summed in int16; at most
// 2 * 15 * 128, no saturation), `vpmaddwd` summing those into int32 lanes; 8 * the block's sum of the row
// (the bias of u) is taken back. One or two rows (a step) take `Row`, more rows (a prompt) `Outputs`, which
// unpacks each block once for all of them, lanes transposed to one output each. Each group's sum is exact
// in int32; it is then converted, multiplied by its scale and added to the output's
// float32 sum, group after group in order, so a row's result does not depend on the rows beside it, and
// a non-finite scale gives what the twin's product gives (0 * inf is NaN).
//
// AVX2 only (with 16 registers there is no second body to hold): it runs on every x86 CPU kvattn's other
// dots run on. Work is split over XLA's intra-op thread pool by blocks of eight outputs; the handler
// returns a future completed by the last part.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvattn::Failed;

namespace {

constexpr int64_t kBlock = 32;   // inputs per packed block of 16 bytes
constexpr int64_t kOutputs = 8;  // outputs worked on together: the int32 lanes of a 256-bit vector
constexpr int64_t kRowByRow = 2;  // up to this many rows, each is its own pass over the weights (`Row`)

#ifdef KVATTN_X86

// Eight rows of eight 32-bit words transposed in place: r[j] held output j's words 0..7 (inputs 4q..4q+3 as
// word q), r[q] then holds word q of outputs 0..7.
KVATTN_AVX2 inline void Transpose8x8(__m256i r[kOutputs]) {
  __m256i t[kOutputs], u[kOutputs];
  for (int j = 0; j < kOutputs; j += 2) {
    t[j] = _mm256_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int j = 0; j < kOutputs; j += 4) {
    u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
    u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
    u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
    u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2x128_si256(u[q], u[q + 4], 0x20);
    r[q + 4] = _mm256_permute2x128_si256(u[q], u[q + 4], 0x31);
  }
}

// `eight[k]` = the scales of group k of the eight outputs whose rows of scales start at `scale`, `stride`
// apart, in `Row`'s lane order (outputs 0, 2, 4, 6, 1, 3, 5, 7): an 8 x 8 transpose of 16-bit values.
KVATTN_AVX2 inline void Transpose(const uint16_t* scale, int64_t stride, uint16_t eight[kOutputs][kOutputs]) {
  __m128i r[kOutputs];
  constexpr int kOrder[kOutputs] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (int j = 0; j < kOutputs; ++j) {
    r[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + kOrder[j] * stride));
  }
  __m128i t[kOutputs], u[kOutputs];
  for (int j = 0; j < kOutputs; j += 2) {
    t[j] = _mm_unpacklo_epi16(r[j], r[j + 1]);
    t[j + 1] = _mm_unpackhi_epi16(r[j], r[j + 1]);
  }
  for (int j = 0; j < kOutputs; j += 4) {
    u[j] = _mm_unpacklo_epi32(t[j], t[j + 2]);
    u[j + 1] = _mm_unpackhi_epi32(t[j], t[j + 2]);
    u[j + 2] = _mm_unpacklo_epi32(t[j + 1], t[j + 3]);
    u[j + 3] = _mm_unpackhi_epi32(t[j + 1], t[j + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    _mm_store_si128(reinterpret_cast<__m128i*>(eight[2 * k]), _mm_unpacklo_epi64(u[k], u[k + 4]));
    _mm_store_si128(reinterpret_cast<__m128i*>(eight[2 * k + 1]), _mm_unpackhi_epi64(u[k], u[k + 4]));
  }
}

// Output n's 16 bytes of block b and its scale of group g, an output's blocks one after another.
struct Rows {
  const uint8_t* packed;
  const uint16_t* scale;
  int64_t half, groups;  // K / 2 and K / group
  const uint8_t* block(int64_t n, int64_t b) const { return packed + n * half + b * 16; }
  uint16_t at(int64_t n, int64_t g) const { return scale[n * groups + g]; }
};

// The same, eight outputs' blocks side by side: tile t holds outputs 8t..8t+7, block b of them in 128 bytes.
struct Tiles {
  const uint8_t* packed;
  const uint16_t* scale;
  int64_t blocks, groups;  // K / 32 and K / group
  const uint8_t* block(int64_t n, int64_t b) const {
    return packed + ((n / kOutputs * blocks + b) * kOutputs + n % kOutputs) * 16;
  }
  uint16_t at(int64_t n, int64_t g) const { return scale[(n / kOutputs * groups + g) * kOutputs + n % kOutputs]; }
};

// Outputs n + 2j and n + 2j + 1's block b, side by side in one vector.
KVATTN_AVX2 inline __m256i TwoBlocks(const Rows& w, int64_t n, int j, int64_t b) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.block(n + 2 * j, b)))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.block(n + 2 * j + 1, b))), 1);
}

KVATTN_AVX2 inline __m256i TwoBlocks(const Tiles& w, int64_t n, int j, int64_t b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block(n + 2 * j, b)));
}

// The bfloat16 bits of group g's scales of outputs [n, n + 8), in `Row`'s lane order (0, 2, 4, 6, 1, 3, 5, 7).
// With whole eights of groups, eight outputs' scales of eight groups are read as eight rows and transposed
// once (`Transpose`, into `eight`), rather than gathered a group at a time.
KVATTN_AVX2 inline __m256i Scales(const Rows& w, int64_t n, int64_t g, uint16_t eight[kOutputs][kOutputs]) {
  if (w.groups % kOutputs == 0) {
    if (g % kOutputs == 0) Transpose(w.scale + n * w.groups + g, w.groups, eight);
    return _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(eight[g % kOutputs])));
  }
  return _mm256_setr_epi32(w.at(n, g), w.at(n + 2, g), w.at(n + 4, g), w.at(n + 6, g), w.at(n + 1, g),
                           w.at(n + 3, g), w.at(n + 5, g), w.at(n + 7, g));
}

KVATTN_AVX2 inline __m256i Scales(const Tiles& w, int64_t n, int64_t g, uint16_t[kOutputs][kOutputs]) {
  const uint16_t* eight_scales = w.scale + (n / kOutputs * w.groups + g) * kOutputs;
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(eight_scales));
  return _mm256_permutevar8x32_epi32(_mm256_cvtepu16_epi32(bits), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}

// One row by eight outputs [n, n + 8), in registers: a step's dot (the blocked loop below re-reads the
// unpacked weights from memory for each row, which a single row does not repay). Two outputs' blocks share a
// vector, 16 bytes each; three rounds of horizontal adds leave the eight group sums in the order
// 0, 2, 4, 6, 1, 3, 5, 7, which the store undoes. The same exact sums and the same float32 recurrence over
// the groups as `Outputs`: the same bits.
template <typename Layout>
KVATTN_AVX2 void Row(const int8_t* a, int64_t K, const Layout& w, int64_t group, const int32_t* sums, float* out,
                     int64_t n) {
  const int64_t groups = K / group, per_group = group / kBlock;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  alignas(16) uint16_t eight[kOutputs][kOutputs];
  for (int64_t g = 0; g < groups; ++g) {
    __m256i total = _mm256_setzero_si256();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const __m128i* x = reinterpret_cast<const __m128i*>(a + b * kBlock);
      const __m256i low = _mm256_broadcastsi128_si256(_mm_loadu_si128(x));
      const __m256i high = _mm256_broadcastsi128_si256(_mm_loadu_si128(x + 1));
      __m256i p[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = TwoBlocks(w, n, j, b);
        const __m256i upper = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(bytes, nibble), low),
                                               _mm256_maddubs_epi16(upper, high));
        p[j] = _mm256_madd_epi16(pairs, ones);
      }
      const __m256i both = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
      total = _mm256_add_epi32(total, _mm256_sub_epi32(both, _mm256_set1_epi32(sums[b])));
    }
    const __m256 d = _mm256_castsi256_ps(_mm256_slli_epi32(Scales(w, n, g, eight), 16));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(total), d));
  }
  _mm256_storeu_ps(out + n, _mm256_permutevar8x32_ps(acc, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// Outputs [n, n + count) (count <= 8) for every row: `sums[m * blocks + b]` is 8 * row m's sum over block b.
// Each block of the eight outputs is unpacked once and transposed (`Transpose8x8`) so that vector q holds
// their inputs 4q..4q+3, lane j output j: for each row, eight `vpmaddubsw` by its four inputs broadcast and
// `vpmaddwd` leave each output's exact block sum in its own lane, with no horizontal adds.
template <typename Layout>
KVATTN_AVX2 void Outputs(const int8_t* a, int64_t M, int64_t K, const Layout& w, int64_t group, const int32_t* sums,
                         float* out, int64_t N, int64_t n, int64_t count, float* acc, int32_t* exact) {
  const int64_t groups = K / group, blocks = K / kBlock, per_group = group / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  std::memset(acc, 0, sizeof(float) * M * kOutputs);
  for (int64_t g = 0; g < groups; ++g) {
    alignas(32) float d[kOutputs] = {};
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t bits = static_cast<uint32_t>(w.at(n + j, g)) << 16;
      std::memcpy(&d[j], &bits, sizeof(float));
    }
    std::memset(exact, 0, sizeof(int32_t) * M * kOutputs);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i u[kOutputs];
      for (int64_t j = 0; j < kOutputs; ++j) {  // outputs past `count` stay zero
        if (j >= count) {
          u[j] = _mm256_setzero_si256();
          continue;
        }
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.block(n + j, b)));
        u[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
      }
      Transpose8x8(u);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* x = a + m * K + b * kBlock;
        __m256i total = _mm256_setzero_si256();
        for (int q = 0; q < kOutputs; ++q) {
          int32_t four;
          std::memcpy(&four, x + 4 * q, sizeof(four));
          const __m256i products = _mm256_maddubs_epi16(u[q], _mm256_set1_epi32(four));
          total = _mm256_add_epi32(total, _mm256_madd_epi16(products, ones));
        }
        int32_t* at = exact + m * kOutputs;
        const __m256i block_sum = _mm256_sub_epi32(total, _mm256_set1_epi32(sums[m * blocks + b]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at),
                            _mm256_add_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)), block_sum));
      }
    }
    const __m256 scales = _mm256_load_ps(d);
    for (int64_t m = 0; m < M; ++m) {
      const __m256i sum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(exact + m * kOutputs));
      const __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scales);
      _mm256_storeu_ps(acc + m * kOutputs, _mm256_add_ps(_mm256_loadu_ps(acc + m * kOutputs), term));
    }
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * N + n, acc + m * kOutputs, sizeof(float) * count);
}

// Every row by outputs [n, n + 8) of one part: one pass per row for one or two rows, else the blocked loop.
template <typename Layout>
void Part(const int8_t* rows, int64_t M, int64_t K, const Layout& w, int64_t group, const int32_t* sums,
          float* result, int64_t N, int64_t first, int64_t last) {
  const int64_t blocks = K / kBlock;
  std::vector<float> acc(std::max<int64_t>(M, 1) * kOutputs);
  std::vector<int32_t> exact(std::max<int64_t>(M, 1) * kOutputs);
  for (int64_t p = first; p < last; ++p) {
    const int64_t n = p * kOutputs;
    if (M <= kRowByRow && n + kOutputs <= N) {
      for (int64_t m = 0; m < M; ++m) Row(rows + m * K, K, w, group, sums + m * blocks, result + m * N, n);
    } else {
      Outputs(rows, M, K, w, group, sums, result, N, n, std::min(kOutputs, N - n), acc.data(), exact.data());
    }
  }
}

ffi::Future Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> a, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::BF16> s,
                ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions(), sd = s.dimensions();
  // Rows: packed (N, K / 2), scales (N, G); tiles: packed (N / 8, K / 32, 8, 16), scales (N / 8, G, 8).
  const bool tiled = wd.size() == 4;
  const bool shaped = tiled ? sd.size() == 3 && wd[2] == kOutputs && wd[3] == 16 && sd[2] == kOutputs && sd[0] == wd[0]
                            : wd.size() == 2 && sd.size() == 2 && sd[0] == wd[0];
  const int64_t N = shaped ? wd[0] * (tiled ? kOutputs : 1) : 0;
  const int64_t K = shaped ? (tiled ? wd[1] * kBlock : 2 * wd[1]) : 0, groups = shaped ? sd[1] : 0;
  const int64_t group = groups ? K / groups : 0;
  if (!shaped || a.dimensions().size() == 0 || a.dimensions().back() != K || K == 0 || group * groups != K ||
      group % kBlock || out->element_count() != a.element_count() / K * N) {
    return Failed("kvattn's int4 dot: rows (..., K), packed (N, K / 2) and scales (N, K / group), or packed "
                  "(N / 8, K / 32, 8, 16) and scales (N / 8, K / group, 8), group a multiple of 32 dividing K, "
                  "into (..., N) expected");
  }
  const int64_t M = a.element_count() / K, blocks = K / kBlock;
  const int8_t* rows = a.typed_data();
  // 8 * row m's sum over block b: what the weights' + 8 added to each block's products.
  auto sums = std::shared_ptr<int32_t[]>(new int32_t[std::max<int64_t>(M * blocks, 1)]);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t total = 0;
      for (int64_t k = 0; k < kBlock; ++k) total += rows[m * K + b * kBlock + k];
      sums[m * blocks + b] = 8 * total;
    }
  }
  const uint8_t* packed = w.typed_data();
  const uint16_t* scale = reinterpret_cast<const uint16_t*>(s.typed_data());
  float* result = out->typed_data();
  const int64_t parts = (N + kOutputs - 1) / kOutputs;
  return kvattn::Split(pool, parts, parts / 8, [=](int64_t first, int64_t last) {
    if (tiled) {
      Part(rows, M, K, Tiles{packed, scale, blocks, groups}, group, sums.get(), result, N, first, last);
    } else {
      Part(rows, M, K, Rows{packed, scale, K / 2, groups}, group, sums.get(), result, N, first, last);
    }
  });
}

KVATTN_KERNEL(int4_dot, Dot);

#endif  // KVATTN_X86

}  // namespace
