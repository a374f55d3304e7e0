// decode-step dot model: M=8 rows over big f32 panels, 2 threads, various prefetch policies
#include <immintrin.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <algorithm>
#include <vector>
#include <omp.h>
constexpr int64_t kLanes=16;
int g_hint=0; int64_t g_near=0;
template <int MR, int NT>
__attribute__((target("avx2,fma"))) void Panel2(const float* a, int64_t K, const float* w, int64_t t, float* out, int64_t ldo, int64_t k0, int64_t k1, int64_t ahead, int par=-1) {
  const float* panels[NT];
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
      const float* at = panels[j] + k * kLanes;
      if (ahead && (par < 0 || (k & 1) == par)) { if (g_hint) _mm_prefetch(reinterpret_cast<const char*>(at) + ahead, _MM_HINT_T1); else _mm_prefetch(reinterpret_cast<const char*>(at) + ahead, _MM_HINT_T0); }
      if (g_near && k + g_near/64 < k1) _mm_prefetch(reinterpret_cast<const char*>(at) + g_near, _MM_HINT_T0);
      b[j][0]=_mm256_loadu_ps(at); b[j][1]=_mm256_loadu_ps(at+8);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_set1_ps(a[i * K + k]);
      for (int j = 0; j < NT; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(x, b[j][0], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(x, b[j][1], acc[i][j][1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) for (int j = 0; j < NT; ++j) {
      _mm256_storeu_ps(out + i * ldo + (t + j) * kLanes, acc[i][j][0]);
      _mm256_storeu_ps(out + i * ldo + (t + j) * kLanes + 8, acc[i][j][1]);
  }
}
template<int MR> void Block(const float* a, int64_t K, const float* w, float* out, int64_t ldo, int64_t t0, int64_t t1, int64_t k0, int64_t k1, int64_t ahead, int par){
  constexpr int S = MR==1?3:MR==2?2:1;
  int64_t t=t0;
  for (;t+S<=t1;t+=S) Panel2<MR,S>(a,K,w,t,out,ldo,k0,k1,ahead,par);
  for (;t<t1;++t) Panel2<MR,1>(a,K,w,t,out,ldo,k0,k1,ahead,par);
}
void Rows(int64_t rows, const float* a, int64_t K, const float* w, float* out, int64_t ldo, int64_t t0, int64_t t1, int64_t k0, int64_t k1, int64_t ahead, int par){
  switch(rows){case 6: Block<6>(a,K,w,out,ldo,t0,t1,k0,k1,ahead,par);break; case 5: Block<5>(a,K,w,out,ldo,t0,t1,k0,k1,ahead,par);break;
   case 4: Block<4>(a,K,w,out,ldo,t0,t1,k0,k1,ahead,par);break; case 3: Block<3>(a,K,w,out,ldo,t0,t1,k0,k1,ahead,par);break; case 2: Block<2>(a,K,w,out,ldo,t0,t1,k0,k1,ahead,par);break; case 1: Block<1>(a,K,w,out,ldo,t0,t1,k0,k1,ahead,par);break; default: abort();}
}
struct Policy { const char* name; std::vector<int> blocks; int64_t tile; int64_t group; int64_t ahead_first, ahead_rest; int par_first=-1, par_rest=-1; int step=0; };
void Part(const float* a, int64_t K, const float* w, float* out, int64_t N, int64_t t0, int64_t t1, const Policy& p){
  for (int64_t g=t0; g<t1; g+=p.group){ int64_t g1=std::min(t1,g+p.group);
    for (int64_t k0=0;k0<K;k0+=p.tile){ int64_t k1=std::min(K,k0+p.tile);
      int64_t step = p.step ? p.step : (g1 - g);
      for (int64_t s0 = g; s0 < g1; s0 += step) { int64_t s1 = std::min(g1, s0 + step);
      int64_t m=0; int bi=0;
      for (int rows: p.blocks){ Rows(rows, a+m*K, K, w, out+m*N, N, s0, s1, k0, k1, bi==0?p.ahead_first:p.ahead_rest, bi==0?p.par_first:p.par_rest); m+=rows; ++bi; }
      }
    }}
}
int main(int argc, char** argv){
  int64_t K=768, N=16*4096; // 201 MB
  float* a=(float*)aligned_alloc(64,8*K*4); float* w=(float*)aligned_alloc(64,K*N*4); int64_t LDO = getenv("LDO") ? atol(getenv("LDO")) : N; float* out=(float*)aligned_alloc(64,8*(LDO+64)*4);
  for(int64_t i=0;i<8*K;i++)a[i]=(i%7)*1e-2f; 
  #pragma omp parallel for
  for(int64_t i=0;i<K*N;i++)w[i]=(i%5)*1e-2f;
  int64_t panels=N/16;
  std::vector<Policy> ps={
    {"1 row", {1}, K, 12, 4096, 4096},
    {"6 rows whole K", {6}, K, 12, 4096, 4096},
    {"6 rows tile64", {6}, 64, 12, 4096, 4096},
    {"2+6 tile64 g12 (current)", {2,6}, 64, 12, 4096, 4096},
    {"2+6 tile128 g12", {2,6}, 128, 12, 8192, 8192},
    {"2+6 tile256 g6", {2,6}, 256, 6, 16384, 16384},
  };
  int reps = argc>1? atoi(argv[1]) : 5; g_hint = getenv("HINT") ? atoi(getenv("HINT")) : 0; g_near = getenv("NEAR") ? atol(getenv("NEAR")) : 0;
  if (argc>2) { // in-cache compute: 16 panels repeated
    int64_t sp=atoi(argv[2]); int64_t rep=panels/sp;
    for (size_t v=0; v<ps.size(); ++v){ std::vector<double> t;
      for(int r=0;r<reps;r++){ double t0=omp_get_wtime();
        #pragma omp parallel num_threads(2)
        { int id=omp_get_thread_num(); for(int64_t q=0;q<rep;q++){ Part(a,K,w,out,LDO,sp*id/2,sp*(id+1)/2,ps[v]); } }
        t.push_back(omp_get_wtime()-t0);}
      std::sort(t.begin(),t.end()); printf("in-cache %-40s median %.2f ms\n", ps[v].name, t[t.size()/2]*1e3); }
    return 0;
  }
  std::vector<std::vector<double>> times(ps.size());
  for (int r=0;r<reps;r++) for (size_t v=0; v<ps.size(); ++v){
      double t0=omp_get_wtime();
      #pragma omp parallel num_threads(2)
      { int id=omp_get_thread_num(); int64_t p0=panels*id/2, p1=panels*(id+1)/2; Part(a,K,w,out,LDO,p0,p1,ps[v]); }
      times[v].push_back(omp_get_wtime()-t0);
  }
  for (size_t v=0; v<ps.size(); ++v){ auto t=times[v]; std::sort(t.begin(),t.end()); double med=t[t.size()/2];
    printf("%-40s median %.2f ms  %.1f GB/s\n", ps[v].name, med*1e3, K*N*4/med/1e9); }
}
