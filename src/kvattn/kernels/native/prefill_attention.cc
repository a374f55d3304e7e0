// kvattn's chunk attention for XLA:CPU: a prefill's new tokens over the filled cache and causally over
// themselves, float32, over a heads-major cache (`prefill_attention`) or a paged pool
// (`paged_prefill_attention`).
//
// Sequence b held cache_len[b] tokens and appends the first new_len[b] of its T new tokens. New token
// t < new_len[b], query head n = k G + g, sees the keys
//   k_cache[b, k, s] for s < cache_len[b], then k_new[b, u, k] for u <= t,
// and gets sum_j softmax_j(q . key_j / sqrt(H)) value_j over them: `kvattn.math.ops.attention` without a
// window or a soft-cap (q scaled by a float32 1/sqrt(H) first, as there). Padding queries
// (t >= new_len[b]) get zeros; nothing past the visible keys is read.
//
// A paged pool is (P, K, page, H), and table[b, j] names the page holding the sequence's slots
// j*page .. (j+1)*page - 1 (an entry outside [0, P) reads page 0 or P - 1): the cached keys are read from
// their pages where they lie, the rest is the same, so the outputs are the contiguous kernel's to the bit.
//
// XLA's path forms the scores, the masked softmax and two batched dots as separate thunks with
// transposes between them. This does one (b, k) pair at a time, the pairs split over XLA's intra-op
// thread pool: the pair's keys are transposed a tile at a time into blocks of 16 (H x 16), so four query rows
// against 32 keys take 8 FMAs per head dim; each row's softmax is exact (its maximum first, then exp
// and sum over its visible keys); values are mixed four rows at a time, 64 head dims per pass.
// Rows go in groups of up to kGroup blocks of four, and keys and values in tiles of kTile: every block of a
// group reads a tile while it is in the core's cache, so a deep cache is read from memory once per
// group rather than once per block of four rows. A row's mix runs over the tiles in order, its running
// sums kept between them: the same sums in the same order as one pass over every key. Keys are transposed
// eight by eight in registers, and while a tile is read the next one's rows are asked for, a row at a time
// (`kvattn::Prefetch`): pages lie anywhere, so the CPU's own prefetcher stops at the end of each.
//
// AVX-512 (`Wide`), else AVX2 and FMA (`Narrow`, sixteen lanes as two halves, a block of keys and sixteen
// head dims per pass: the same sums in the same order, the same bits).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvattn/kernels/native/native.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvattn::Failed;

namespace {

struct Shape {
  int64_t B, T, K, G, H, S;
  float scale;  // 1/sqrt(H), rounded to float32 as kvattn.math.ops rounds it
};

constexpr int64_t kRows = 4;    // query rows per block
constexpr int64_t kLanes = 16;  // floats per vector
constexpr int64_t kGroup = 16;  // blocks of rows per group
constexpr int64_t kTile = 256;  // keys per tile: 64 KiB of keys and as much of values at H = 64

struct Scratch {
  std::vector<float> keys;            // (kTile / 16, H, 16): one tile of the pair's keys, transposed
  std::vector<float> zeros;           // (H,): the keys past the visible ones
  std::vector<const float*> key_rows; // a row pointer per visible key
  std::vector<const float*> values;   // a row pointer per visible key
  std::vector<float> scores;          // (group rows, stride): scores, then weights, of one group of rows
  std::vector<float> queries;         // (kGroup * 4, H): one group's queries, scaled
  std::vector<float> sums;            // (kGroup * 4, H): one group's running mixes of values
};

#ifdef KVATTN_X86

using kvattn::Exp;
using kvattn::Prefetch;

// The vector steps of one block of kRows query rows, AVX-512 (`Wide`) or AVX2 and FMA (`Narrow`, sixteen
// lanes as two halves, `kvattn::F16`): the same operations lane for lane, each sum in the same order, so
// the two bodies give the same bits. `Pair` below is the scalar rest, shared.
//
// Scores: scores[i * stride + j] = qs[i] . key j over the `count` keys of `keys` (blocks of (H, 16),
// transposed; `count` a multiple of 32).
// Softmax: row[j] <- exp(row[j] - max) over the `seen` first keys, 0 past them; returns 1 / their sum.
// Mix: sums[i] += sum_j weights[i * stride + j] values[j] over the keys j in [from, to) that row i sees
// (j < seen[i], seen rising with i), in order; `sums` (4, H) start at 0 when `fresh`. A key a row does not
// see is skipped, not weighted by 0: 0 * a NaN or inf value is NaN, and it must not reach an earlier token.
struct Wide {
  template <int C>
  KVATTN_AVX512 static void MixColumns(const float* const* values, int64_t column, const int64_t* seen,
                                       const float* weights, int64_t stride, int64_t from, int64_t to,
                                       float* sums, int64_t H, bool fresh, int64_t fetch) {
    __m512 acc[kRows][C];
    for (int i = 0; i < kRows; ++i)
      for (int c = 0; c < C; ++c)
        acc[i][c] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + i * H + column + kLanes * c);
    for (int64_t j = from; j < std::min(to, seen[kRows - 1]); ++j) {
      if (j + kTile < fetch) Prefetch(values[j + kTile], H);
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(values[j] + column + kLanes * c);
      const bool every_row = j < seen[0];
      for (int i = 0; i < kRows; ++i) {
        const __m512 w = _mm512_set1_ps(weights[i * stride + j]);
        const __mmask16 sees = every_row || j < seen[i] ? 0xFFFF : 0;
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_mask3_fmadd_ps(w, v[c], acc[i][c], sees);
      }
    }
    for (int i = 0; i < kRows; ++i)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(sums + i * H + column + kLanes * c, acc[i][c]);
  }

  static void Mix(const float* const* values, int64_t H, const int64_t* seen, const float* weights, int64_t stride,
                  int64_t from, int64_t to, float* sums, bool fresh, int64_t fetch) {
    for (int64_t column = 0; column < H; column += 4 * kLanes) {
      const int64_t ask = column == 0 ? fetch : 0;
      switch (std::min<int64_t>(4, (H - column) / kLanes)) {
        case 4: MixColumns<4>(values, column, seen, weights, stride, from, to, sums, H, fresh, ask); break;
        case 3: MixColumns<3>(values, column, seen, weights, stride, from, to, sums, H, fresh, ask); break;
        case 2: MixColumns<2>(values, column, seen, weights, stride, from, to, sums, H, fresh, ask); break;
        default: MixColumns<1>(values, column, seen, weights, stride, from, to, sums, H, fresh, ask); break;
      }
    }
  }

  KVATTN_AVX512 static void Scores(const float* keys, const float* const* qs, int64_t H, int64_t count,
                                   float* scores, int64_t stride) {
    for (int64_t block = 0; block < count / kLanes; block += 2) {  // two blocks per pass
      const float* k0 = keys + block * H * kLanes;
      const float* k1 = k0 + H * kLanes;
      __m512 acc[kRows][2];
      for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; ++h) {
        const __m512 a = _mm512_loadu_ps(k0 + h * kLanes), c = _mm512_loadu_ps(k1 + h * kLanes);
        for (int i = 0; i < kRows; ++i) {
          const __m512 x = _mm512_set1_ps(qs[i][h]);
          acc[i][0] = _mm512_fmadd_ps(x, a, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(x, c, acc[i][1]);
        }
      }
      for (int i = 0; i < kRows; ++i) {
        _mm512_storeu_ps(scores + i * stride + block * kLanes, acc[i][0]);
        _mm512_storeu_ps(scores + i * stride + (block + 1) * kLanes, acc[i][1]);
      }
    }
  }

  KVATTN_AVX512 static float Softmax(float* row, int64_t seen, int64_t padded) {
    auto mask = [&](int64_t j) {
      const int64_t left = seen - j;
      return left >= kLanes ? static_cast<__mmask16>(0xFFFF)
                            : static_cast<__mmask16>(left <= 0 ? 0 : (1u << left) - 1);
    };
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    __mmask16 unordered = 0;  // a NaN score makes the row NaN, as in a float64 softmax
    for (int64_t j = 0; j < seen; j += kLanes) kvattn::Fold(_mm512_loadu_ps(row + j), mask(j), top, unordered);
    const __m512 high = _mm512_set1_ps(kvattn::Maximum(top, unordered));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += kLanes) {
      const __m512 w = _mm512_maskz_mov_ps(mask(j), Exp(_mm512_sub_ps(_mm512_loadu_ps(row + j), high)));
      _mm512_storeu_ps(row + j, w);
      sum = _mm512_add_ps(sum, w);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);  // at least the row's own key: sum >= 1, or NaN
  }
};

// Eight keys (rows of H floats, H a multiple of 8) into the lanes of `column`: column[h * 16 + i] = rows[i][h],
// eight head dims at a time through an 8 x 8 transposition in registers.
KVATTN_AVX2 void Transpose8(const float* const* rows, int64_t H, float* column) {
  for (int64_t h = 0; h < H; h += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + h);
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // then fours: u[4 i + d] holds dims d and d + 4 of rows 4 i .. 4 i + 3
      u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int d = 0; d < 4; ++d) {
      _mm256_storeu_ps(column + (h + d) * kLanes, _mm256_permute2f128_ps(u[d], u[4 + d], 0x20));
      _mm256_storeu_ps(column + (h + d + 4) * kLanes, _mm256_permute2f128_ps(u[d], u[4 + d], 0x31));
    }
  }
}

struct Narrow {
  using F16 = kvattn::F16;

  // Sixteen columns a pass (four rows of two halves stay in registers).
  KVATTN_AVX2 static void Mix(const float* const* values, int64_t H, const int64_t* seen, const float* weights,
                              int64_t stride, int64_t from, int64_t to, float* sums, bool fresh, int64_t fetch) {
    for (int64_t column = 0; column < H; column += kLanes) {
      const int64_t ask = column == 0 ? fetch : 0;
      F16 acc[kRows];
      for (int i = 0; i < kRows; ++i) acc[i] = fresh ? kvattn::Splat16(0.0f) : kvattn::Load16(sums + i * H + column);
      for (int64_t j = from; j < std::min(to, seen[kRows - 1]); ++j) {
        if (j + kTile < ask) Prefetch(values[j + kTile], H);
        const F16 v = kvattn::Load16(values[j] + column);
        const bool every_row = j < seen[0];
        for (int i = 0; i < kRows; ++i) {
          if (every_row || j < seen[i]) {
            acc[i] = kvattn::Fmadd16(kvattn::Splat16(weights[i * stride + j]), v, acc[i]);
          }
        }
      }
      for (int i = 0; i < kRows; ++i) kvattn::Store16(sums + i * H + column, acc[i]);
    }
  }

  // One block of sixteen keys a pass.
  KVATTN_AVX2 static void Scores(const float* keys, const float* const* qs, int64_t H, int64_t count,
                                 float* scores, int64_t stride) {
    for (int64_t block = 0; block < count / kLanes; ++block) {
      const float* k0 = keys + block * H * kLanes;
      F16 acc[kRows];
      for (int i = 0; i < kRows; ++i) acc[i] = kvattn::Splat16(0.0f);
      for (int64_t h = 0; h < H; ++h) {
        const F16 a = kvattn::Load16(k0 + h * kLanes);
        for (int i = 0; i < kRows; ++i) acc[i] = kvattn::Fmadd16(kvattn::Splat16(qs[i][h]), a, acc[i]);
      }
      for (int i = 0; i < kRows; ++i) kvattn::Store16(scores + i * stride + block * kLanes, acc[i]);
    }
  }

  KVATTN_AVX2 static float Softmax(float* row, int64_t seen, int64_t padded) {
    F16 top = kvattn::Splat16(-__builtin_inff());
    __m256 unordered = _mm256_setzero_ps();
    for (int64_t j = 0; j < seen; j += kLanes) {
      kvattn::Fold16(kvattn::Load16(row + j), kvattn::Lanes16(seen - j), top, unordered);
    }
    const F16 high = kvattn::Splat16(kvattn::Maximum16(top, unordered));
    F16 sum = kvattn::Splat16(0.0f);
    for (int64_t j = 0; j < padded; j += kLanes) {
      const F16 w = kvattn::Keep16(kvattn::Lanes16(seen - j),
                                   kvattn::Exp16(kvattn::Sub16(kvattn::Load16(row + j), high)));
      kvattn::Store16(row + j, w);
      sum = kvattn::Add16(sum, w);
    }
    return 1.0f / kvattn::Sum16(sum);
  }
};

// Where cached slot j of pair (b, k) lies in a contiguous cache (B, K, S, H): its offset in floats.
// `run(j)`: how many slots from j lie one after another (every one left).
struct Contiguous {
  int64_t K, S, H;
  int64_t operator()(int64_t b, int64_t k, int64_t j) const { return ((b * K + k) * S + j) * H; }
  int64_t run(int64_t j) const { return S - j; }
};

// Where cached slot j of pair (b, k) lies in a paged pool (P, K, page, H) through the table (B, M).
struct Pages {
  const int32_t* table;
  int64_t M, P, K, page, H;
  int64_t operator()(int64_t b, int64_t k, int64_t j) const {
    const int64_t at = std::clamp<int64_t>(table[b * M + j / page], 0, P - 1);
    return ((at * K + k) * page + j % page) * H;
  }
  int64_t run(int64_t j) const { return page - j % page; }  // the rest of j's page
};

template <typename Body, typename Slots>
void Pair(const Shape& d, int64_t b, int64_t k, const float* q, const float* k_new, const float* v_new,
          const float* k_cache, const float* v_cache, Slots slot, int64_t cached, int64_t fresh, float* out,
          Scratch& scratch) {
  const int64_t T = d.T, K = d.K, G = d.G, H = d.H, N = K * G;
  const int64_t visible = cached + fresh;
  const int64_t blocks = (visible + 2 * kLanes - 1) / (2 * kLanes) * 2;  // even: the wide body's two per pass
  scratch.keys.resize(kTile * H);
  scratch.zeros.assign(H, 0.0f);
  scratch.key_rows.resize(visible);
  scratch.values.resize(visible);
  for (int64_t j = 0; j < cached;) {  // a run of slots at a time: one page lookup per run
    const int64_t at = slot(b, k, j), run = std::min(slot.run(j), cached - j);
    for (int64_t s = 0; s < run; ++s, ++j) {
      scratch.key_rows[j] = k_cache + at + s * H;
      scratch.values[j] = v_cache + at + s * H;
    }
  }
  for (int64_t j = cached; j < visible; ++j) {
    const int64_t at = ((b * T + j - cached) * K + k) * H;
    scratch.key_rows[j] = k_new + at;
    scratch.values[j] = v_new + at;
  }
  // Keys [tile, tile + count) transposed into the tile's blocks of (H, 16), zeros past the visible ones: read
  // from where they lie while the tile is scored, so a pass over a deep cache reads each key once.
  auto transpose = [&](int64_t tile, int64_t count) {
    for (int64_t j = tile; j < tile + count; j += 8) {
      const float* rows[8];
      for (int64_t i = 0; i < 8; ++i) {
        rows[i] = j + i < visible ? scratch.key_rows[j + i] : scratch.zeros.data();
        if (j + i + kTile < visible) Prefetch(scratch.key_rows[j + i + kTile], H);
      }
      Transpose8(rows, H, scratch.keys.data() + (j - tile) / kLanes * H * kLanes + j % kLanes);
    }
  };
  auto row_of = [&](auto* base, int64_t t, int64_t g) { return base + ((b * T + t) * N + k * G + g) * H; };
  for (int64_t t = fresh; t < T; ++t)  // padding queries
    for (int64_t g = 0; g < G; ++g) std::fill_n(row_of(out, t, g), H, 0.0f);

  const int64_t rows = fresh * G;  // (t, g), t-major: a block's last row sees the most keys
  if (rows == 0) return;  // an idle sequence (a warm-up call's): nothing to attend, maybe nothing visible
  const int64_t stride = blocks * kLanes;  // every visible key, rounded up to 32
  // Fewer blocks a group over a cache so deep that a full group's scores would pass 4 MiB.
  const int64_t per_group = std::clamp<int64_t>((int64_t{1} << 20) / (kRows * stride), 1, kGroup);
  scratch.scores.resize(std::min(per_group * kRows, (rows + kRows - 1) / kRows * kRows) * stride);
  scratch.queries.resize(kGroup * kRows * H);
  scratch.sums.resize(kGroup * kRows * H);
  struct Block {
    const float* qs[kRows];
    float* outs[kRows];
    int64_t seen[kRows];
    int64_t n, padded;  // its real rows; its last row's keys, rounded up to 32
  };
  for (int64_t start = 0; start < rows; start += per_group * kRows) {
    const int64_t count = std::min(per_group * kRows, rows - start), members = (count + kRows - 1) / kRows;
    Block group[kGroup];
    for (int64_t m = 0; m < members; ++m) {
      Block& block = group[m];
      const int64_t first = start + m * kRows;
      block.n = std::min(kRows, rows - first);
      for (int64_t i = 0; i < kRows; ++i) {  // rows past the end repeat the last one
        const int64_t r = first + std::min(i, block.n - 1);
        float* scaled = scratch.queries.data() + (m * kRows + i) * H;
        std::transform(row_of(q, r / G, r % G), row_of(q, r / G, r % G) + H, scaled,
                       [&](float x) { return x * d.scale; });
        block.qs[i] = scaled;
        block.outs[i] = row_of(out, r / G, r % G);
        block.seen[i] = cached + r / G + 1;
      }
      block.padded = (block.seen[kRows - 1] + 2 * kLanes - 1) / (2 * kLanes) * (2 * kLanes);
    }
    const int64_t reach = group[members - 1].padded;
    auto scores_of = [&](int64_t m) { return scratch.scores.data() + m * kRows * stride; };
    for (int64_t tile = 0; tile < reach; tile += kTile) {  // every block's scores against the tile's keys
      transpose(tile, std::min(kTile, reach - tile));
      for (int64_t m = 0; m < members; ++m) {
        if (group[m].padded <= tile) continue;
        Body::Scores(scratch.keys.data(), group[m].qs, H, std::min(kTile, group[m].padded - tile),
                     scores_of(m) + tile, stride);
      }
    }
    float inv[kGroup][kRows];
    for (int64_t m = 0; m < members; ++m)
      for (int64_t i = 0; i < kRows; ++i)
        inv[m][i] = Body::Softmax(scores_of(m) + i * stride, group[m].seen[i], group[m].padded);
    for (int64_t tile = 0; tile < reach; tile += kTile) {  // every block's values of the tile, in order
      for (int64_t m = 0; m < members; ++m) {
        if (group[m].seen[kRows - 1] <= tile) continue;
        Body::Mix(scratch.values.data(), H, group[m].seen, scores_of(m), stride, tile, tile + kTile,
                  scratch.sums.data() + m * kRows * H, tile == 0, m == 0 ? visible : 0);
      }
    }
    for (int64_t m = 0; m < members; ++m) {
      const float* sums = scratch.sums.data() + m * kRows * H;
      for (int64_t i = 0; i < group[m].n; ++i)
        for (int64_t h = 0; h < H; ++h) group[m].outs[i][h] = sums[i * H + h] * inv[m][i];
    }
  }
}

// One (b, k) pair on the CPU's body.
template <typename Slots>
void OnePair(bool wide, const Shape& d, int64_t b, int64_t k, const float* q, const float* k_new, const float* v_new,
             const float* k_cache, const float* v_cache, Slots slot, int64_t cached, int64_t fresh, float* out,
             Scratch& scratch) {
  if (wide) {
    Pair<Wide>(d, b, k, q, k_new, v_new, k_cache, v_cache, slot, cached, fresh, out, scratch);
  } else {
    Pair<Narrow>(d, b, k, q, k_new, v_new, k_cache, v_cache, slot, cached, fresh, out, scratch);
  }
}


using Rank4 = ffi::Buffer<ffi::F32, 4>;
using Lengths = ffi::Buffer<ffi::S32, 1>;

ffi::Future Attend(ffi::ThreadPool pool, Rank4 q, Rank4 k_new, Rank4 v_new, Rank4 k_cache, Rank4 v_cache,
                   Lengths cache_len, Lengths new_len, ffi::Result<Rank4> out) {
  const auto qd = q.dimensions(), nd = k_new.dimensions(), cd = k_cache.dimensions();
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], K = nd[2], S = cd[2];
  const auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (nd[0] != B || nd[1] != T || nd[3] != H || K == 0 || N % K != 0 || !same(nd, v_new.dimensions()) ||
      cd[0] != B || cd[1] != K || cd[3] != H || !same(cd, v_cache.dimensions()) ||
      cache_len.dimensions()[0] != B || new_len.dimensions()[0] != B || H % kLanes != 0) {
    return Failed("kvattn prefill attention: q (B, T, N, H), new keys and values (B, T, K, H) with K dividing N, "
                  "caches (B, K, S, H), lengths (B,), H % 16 == 0");
  }
  const Shape shape{B, T, K, N / K, H, S, static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)))};
  const float *qp = q.typed_data(), *knp = k_new.typed_data(), *vnp = v_new.typed_data();
  const float *kcp = k_cache.typed_data(), *vcp = v_cache.typed_data();
  const int32_t *held = cache_len.typed_data(), *added = new_len.typed_data();
  float* op = out->typed_data();
  const bool wide = kvattn::Avx512();
  return kvattn::Split(pool, B * K, B * K, [=](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / K;
      OnePair(wide, shape, b, pair % K, qp, knp, vnp, kcp, vcp, Contiguous{K, S, H},
              std::clamp<int64_t>(held[b], 0, S), std::clamp<int64_t>(added[b], 0, T), op, scratch);
    }
  });
}

KVATTN_KERNEL(prefill_attention, Attend);

using Table = ffi::Buffer<ffi::S32, 2>;

ffi::Future AttendPages(ffi::ThreadPool pool, Rank4 q, Rank4 k_new, Rank4 v_new, Rank4 k_pages, Rank4 v_pages,
                        Table table, Lengths cache_len, Lengths new_len, ffi::Result<Rank4> out) {
  const auto qd = q.dimensions(), nd = k_new.dimensions(), pd = k_pages.dimensions(), td = table.dimensions();
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], K = nd[2], P = pd[0], page = pd[2], M = td[1];
  const auto same = [](auto a, auto b) { return std::equal(a.begin(), a.end(), b.begin(), b.end()); };
  if (nd[0] != B || nd[1] != T || nd[3] != H || K == 0 || N % K != 0 || !same(nd, v_new.dimensions()) ||
      P < 1 || page < 1 || pd[1] != K || pd[3] != H || !same(pd, v_pages.dimensions()) || td[0] != B ||
      cache_len.dimensions()[0] != B || new_len.dimensions()[0] != B || H % kLanes != 0) {
    return Failed("kvattn paged prefill attention: q (B, T, N, H), new keys and values (B, T, K, H) with K "
                  "dividing N, pools (P, K, page, H), table (B, M), lengths (B,), H % 16 == 0");
  }
  const Shape shape{B, T, K, N / K, H, M * page, static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)))};
  const float *qp = q.typed_data(), *knp = k_new.typed_data(), *vnp = v_new.typed_data();
  const float *kpp = k_pages.typed_data(), *vpp = v_pages.typed_data();
  const int32_t *tp = table.typed_data(), *held = cache_len.typed_data(), *added = new_len.typed_data();
  float* op = out->typed_data();
  const bool wide = kvattn::Avx512();
  return kvattn::Split(pool, B * K, B * K, [=](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / K;
      OnePair(wide, shape, b, pair % K, qp, knp, vnp, kpp, vpp, Pages{tp, M, P, K, page, H},
              std::clamp<int64_t>(held[b], 0, M * page), std::clamp<int64_t>(added[b], 0, T), op, scratch);
    }
  });
}

KVATTN_KERNEL(paged_prefill_attention, AttendPages);

#endif  // KVATTN_X86

}  // namespace
