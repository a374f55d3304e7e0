// M=8 rows over f32 panels: current 2+6 tiled vs transposed-rows (8 rows in one ymm, weights broadcast)
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
constexpr int64_t kLanes=16;
#include "f32_rows_transposed_current.inc"
// pass over 12 (or C) columns starting at column c0 of the group at panel t: acc[j] = rows of column c0+j
int g_hint=1; int g_even=0;
template <int C0, int C>
__attribute__((target("avx2,fma"), always_inline)) inline void Pass(const float* at, int64_t K, const float* w, int64_t t, float* out, int64_t ldo,
    const float* pre, int64_t pre_n) {
  const float* p0 = w + t * K * kLanes;
  const int64_t ps = K * kLanes;
  __m256 acc[C];
  for (int j = 0; j < C; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (g_even ? ((k & 3) != 3 && (k - (k >> 2)) < pre_n) : k < pre_n) { const int64_t kk = g_even ? k - (k >> 2) - 1 + 1 : k; (void)kk; switch (g_hint) { case 0: _mm_prefetch(reinterpret_cast<const char*>(pre + (g_even ? k - (k >> 2) : k) * 16), _MM_HINT_T0); break; case 1: _mm_prefetch(reinterpret_cast<const char*>(pre + (g_even ? k - (k >> 2) : k) * 16), _MM_HINT_T1); break; case 2: _mm_prefetch(reinterpret_cast<const char*>(pre + (g_even ? k - (k >> 2) : k) * 16), _MM_HINT_T2); break; default: _mm_prefetch(reinterpret_cast<const char*>(pre + (g_even ? k - (k >> 2) : k) * 16), _MM_HINT_NTA);} }
    const __m256 x = _mm256_loadu_ps(at + k * 8);
    const float* row = p0 + k * kLanes;
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) {
      constexpr int dummy = 0; (void)dummy;
      const int c = C0 + j;
      acc[j] = _mm256_fmadd_ps(x, _mm256_broadcast_ss(row + (c / 16) * ps + c % 16), acc[j]);
    }
  }
  alignas(32) float tmp[C][8];
  for (int j = 0; j < C; ++j) _mm256_store_ps(tmp[j], acc[j]);
  for (int r = 0; r < 8; ++r) for (int j = 0; j < C; ++j) { int c = C0 + j; out[r * ldo + t * 16 + c] = tmp[j][r]; }
}
int g_pre = 1; int g_pd = 1; int g_m = 8; int g_rep = 1;
void T8Part(const float* at, int64_t K, const float* w, float* out, int64_t N, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + 3 <= t1; t += 3) {
    // prefetch the next group: 3 panels * K lines spread over the 4 passes
    const float* nxt = w + (t + 3 * g_pd) * K * kLanes; int64_t lines = (t + 3 * g_pd + 3 <= t1 ? 3 : std::max<int64_t>(0, t1 - t - 3 * g_pd)) * K;
    int64_t per = g_pre ? (lines + 3) / 4 : 0;
    Pass<0,12>(at, K, w, t, out, N, nxt, std::min(per, lines));
    Pass<12,12>(at, K, w, t, out, N, nxt + per * 16, std::min(per, std::max<int64_t>(0, lines - per)));
    Pass<24,12>(at, K, w, t, out, N, nxt + 2 * per * 16, std::min(per, std::max<int64_t>(0, lines - 2 * per)));
    Pass<36,12>(at, K, w, t, out, N, nxt + 3 * per * 16, std::min(per, std::max<int64_t>(0, lines - 3 * per)));
  }
  for (; t < t1; ++t) { Pass<0,8>(at, K, w, t, out, N, nullptr, 0); Pass<8,8>(at, K, w, t, out, N, nullptr, 0); }
}
int main(int argc, char** argv){
  int64_t K = argc>2 ? atol(argv[2]) : 768, N = argc>3 ? atol(argv[3]) : 16*4096;
  float* a=(float*)aligned_alloc(64,8*K*4); float* w=(float*)aligned_alloc(64,K*N*4);
  float* out=(float*)aligned_alloc(64,8*N*4); float* out2=(float*)aligned_alloc(64,8*N*4);
  float* at=(float*)aligned_alloc(64,8*K*4);
  for(int64_t i=0;i<8*K;i++)a[i]=((i*37)%101)*1e-2f-0.5f;
  #pragma omp parallel for
  for(int64_t i=0;i<K*N;i++)w[i]=((i*13)%97)*1e-2f-0.4f;
  int64_t panels=N/16; int reps = argc>1? atoi(argv[1]) : 7;
  g_pre = getenv("PRE") ? atoi(getenv("PRE")) : 1; g_rep = getenv("REP") ? atoi(getenv("REP")) : 1; g_pd = getenv("PD") ? atoi(getenv("PD")) : 1; g_m = getenv("M") ? atoi(getenv("M")) : 8; g_hint = getenv("HINT") ? atoi(getenv("HINT")) : 1; g_even = getenv("EVEN") ? atoi(getenv("EVEN")) : 0;
  std::vector<double> tc, tt;
  for (int r=0;r<reps;r++){
    double t0=omp_get_wtime();
    #pragma omp parallel num_threads(2)
    { int id=omp_get_thread_num(); for(int q=0;q<g_rep;q++) Part<Avx2Body>(a,g_m,K,w,out,N,panels*id/2,panels*(id+1)/2); }
    tc.push_back(omp_get_wtime()-t0);
    t0=omp_get_wtime();
    for (int64_t k=0;k<K;k++) for(int i=0;i<8;i++) at[k*8+i]=a[i*K+k];
    #pragma omp parallel num_threads(2)
    { int id=omp_get_thread_num(); for(int q=0;q<g_rep;q++) T8Part(at,K,w,out2,N,panels*id/2,panels*(id+1)/2); }
    tt.push_back(omp_get_wtime()-t0);
  }
  std::sort(tc.begin(),tc.end()); std::sort(tt.begin(),tt.end());
  printf("K=%ld N=%ld %.0f MB: current %.2f ms (min %.2f)   t8 %.2f ms (min %.2f)   bits equal %d\n", K, N, K*N*4/1e6,
     tc[reps/2]*1e3, tc[0]*1e3, tt[reps/2]*1e3, tt[0]*1e3, memcmp(out,out2,8*N*4)==0);
}
