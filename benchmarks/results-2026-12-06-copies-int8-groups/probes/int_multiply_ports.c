#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#define N 100000000L
int main(){
  double t0=omp_get_wtime();
  __m256i a[12]; __m256i b=_mm256_set1_epi8(3);
  for(int i=0;i<12;i++) a[i]=_mm256_set1_epi8(i);
  for(long it=0;it<N;it++){
    for(int i=0;i<12;i++) a[i]=_mm256_maddubs_epi16(a[i],b);
    __asm__ volatile("" : "+x"(a[0]),"+x"(a[1]),"+x"(a[2]),"+x"(a[3]),"+x"(a[4]),"+x"(a[5]),"+x"(a[6]),"+x"(a[7]),"+x"(a[8]),"+x"(a[9]),"+x"(a[10]),"+x"(a[11]));
  }
  double t=omp_get_wtime()-t0;
  printf("maddubs: %.2f per cycle at 3.35GHz\n", N*12/t/3.35e9);
  t0=omp_get_wtime();
  for(long it=0;it<N;it++){
    for(int i=0;i<12;i++) a[i]=_mm256_madd_epi16(a[i],b);
    __asm__ volatile("" : "+x"(a[0]),"+x"(a[1]),"+x"(a[2]),"+x"(a[3]),"+x"(a[4]),"+x"(a[5]),"+x"(a[6]),"+x"(a[7]),"+x"(a[8]),"+x"(a[9]),"+x"(a[10]),"+x"(a[11]));
  }
  t=omp_get_wtime()-t0;
  printf("madd: %.2f per cycle\n", N*12/t/3.35e9);
  t0=omp_get_wtime();
  for(long it=0;it<N;it++){
    for(int i=0;i<6;i++) a[i]=_mm256_madd_epi16(a[i],b);
    for(int i=6;i<12;i++) a[i]=_mm256_maddubs_epi16(a[i],b);
    __asm__ volatile("" : "+x"(a[0]),"+x"(a[1]),"+x"(a[2]),"+x"(a[3]),"+x"(a[4]),"+x"(a[5]),"+x"(a[6]),"+x"(a[7]),"+x"(a[8]),"+x"(a[9]),"+x"(a[10]),"+x"(a[11]));
  }
  t=omp_get_wtime()-t0;
  printf("mixed: %.2f per cycle\n", N*12/t/3.35e9);
  __m256 f[6]; __m256 g=_mm256_set1_ps(1.0f);
  for(int i=0;i<6;i++) f[i]=_mm256_set1_ps(i);
  t0=omp_get_wtime();
  for(long it=0;it<N;it++){
    for(int i=0;i<6;i++) a[i]=_mm256_madd_epi16(a[i],b);
    for(int i=0;i<6;i++) f[i]=_mm256_fmadd_ps(f[i],g,g);
    __asm__ volatile("" : "+x"(a[0]),"+x"(a[1]),"+x"(a[2]),"+x"(a[3]),"+x"(a[4]),"+x"(a[5]),"+x"(f[0]),"+x"(f[1]),"+x"(f[2]),"+x"(f[3]),"+x"(f[4]),"+x"(f[5]));
  }
  t=omp_get_wtime()-t0;
  printf("madd+fma: %.2f per cycle\n", N*12/t/3.35e9);
  int s=0; int tmp[8]; _mm256_storeu_si256((__m256i*)tmp,a[3]); s=tmp[0]; float ft[8]; _mm256_storeu_ps(ft,f[1]); printf("%d %f\n",s, ft[0]);
}
