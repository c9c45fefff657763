// How fast can one CTA per SM gather random 576-byte rows (a MODEL1 token's data) from HBM into shared
// memory, with no compute: the ceiling of the paged fp8 decode kernel's reads (docs/lab/decode.md).
// One CTA per SM (128 threads) streams 2560 rows through a ring of `depth` 64-row slots (depth slots in
// flight); all rows are distinct (a random permutation of a 302 MB cache, so nothing is read twice),
// copied by cp.async 16 B (the kernel's way: 4 threads per row), by cp.async.bulk (the TMA engine, one
// copy per row or two per row: 256 + 320 B), or by cp.async 16 B with the L2::256B prefetch hint.
// Prints a table of GB/s. A second table: 1024-byte rows (a bf16 512-dim prefill kv row) drawn with
// repetition from an 8 MB cache that stays in L2 (prefill's case: s_kv 8192 rows read by every query
// token), no flush: the gather rate a few-head prefill kernel could reach at best.
// Build and run on the GPU: nvcc -arch=sm_90a -O3 -o /tmp/bench_row_gather scripts/bench_row_gather.cu && /tmp/bench_row_gather
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>

__device__ __forceinline__ unsigned sp(const void *p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t *b, unsigned n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sp(b)), "r"(n)); }
__device__ __forceinline__ void bar_wait(uint64_t *b, unsigned ph) {
  asm volatile("{\n.reg .pred P1;\nW: mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n@P1 bra D;\nbra W;\nD:\n}" ::"r"(sp(b)), "r"(ph));
}
__device__ __forceinline__ void bar_expect(uint64_t *b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sp(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk(void *dst, const void *src, unsigned bytes, uint64_t *b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(sp(dst)), "l"(src), "r"(bytes), "r"(sp(b)) : "memory");
}
__device__ __forceinline__ void cp16(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sp(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp16_l2(void *dst, const void *src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(sp(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void noinc(uint64_t *b) { asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(sp(b)) : "memory"); }

constexpr int BLK = 64;
enum Mode { CP_ASYNC = 0, BULK_ROW = 1, BULK_TWO_PIECES = 2, CP_ASYNC_L2_256B = 3, N_MODES = 4 };

template <int ROW>
__global__ void __launch_bounds__(128, 1) gather(const uint8_t *__restrict__ cache, const int *__restrict__ rows,
                                                 int rows_per_cta, int depth, int mode) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[8];
  const int t = threadIdx.x;
  if (t == 0)
    for (int i = 0; i < depth; ++i) bar_init(&bars[i], mode == CP_ASYNC || mode == CP_ASYNC_L2_256B ? 128 : 64);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const int *my = rows + (size_t)blockIdx.x * rows_per_cta;
  const int nblk = rows_per_cta / BLK;
  for (int k = 0; k < nblk; ++k) {
    const int slot = k % depth;
    if (k >= depth) bar_wait(&bars[slot], ((k / depth) - 1) & 1);
    uint8_t *dst = smem + (size_t)slot * BLK * ROW;
    if (mode == CP_ASYNC || mode == CP_ASYNC_L2_256B) {  // 64 rows x ROW/16 chunks, 128 threads: 4 per row, 2 passes
      for (int r = 0; r < 2; ++r) {
        const int j = r * 32 + t / 4;
        const uint8_t *src = cache + (size_t)my[k * BLK + j] * ROW;
        for (int c = t % 4; c < ROW / 16; c += 4) {
          if (mode == CP_ASYNC) cp16(dst + j * ROW + c * 16, src + c * 16);
          else cp16_l2(dst + j * ROW + c * 16, src + c * 16);
        }
      }
      noinc(&bars[slot]);
    } else if (t < 64) {
      const uint8_t *src = cache + (size_t)my[k * BLK + t] * ROW;
      bar_expect(&bars[slot], ROW);
      if (mode == BULK_ROW) {
        bulk(dst + t * ROW, src, ROW, &bars[slot]);
      } else {
        bulk(dst + t * ROW, src, 256, &bars[slot]);
        bulk(dst + t * ROW + 256, src + 256, ROW - 256, &bars[slot]);
      }
    }
  }
  for (int k = (nblk > depth ? nblk - depth : 0); k < nblk; ++k) bar_wait(&bars[k % depth], (k / depth) & 1);
}

// One table: every mode at every depth; rows_per_cta rows per SM from a cache of n_cache rows of ROW bytes,
// distinct rows (a permutation) with an L2 flush before each launch, or rows drawn with repetition and no
// flush (resident: the cache fits in L2).
template <int ROW>
int run_table(int sms, int n_cache, int rows_per_cta, bool resident, std::initializer_list<int> depths) {
  std::vector<int> h(sms * (size_t)rows_per_cta);
  std::mt19937 g(1);
  if (resident) {
    std::uniform_int_distribution<int> pick(0, n_cache - 1);
    for (auto &r : h) r = pick(g);
  } else {
    if (h.size() > (size_t)n_cache) { printf("error: %d SMs need more than %d distinct rows\n", sms, n_cache); return 1; }
    std::vector<int> perm(n_cache);
    for (int i = 0; i < n_cache; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), g);
    std::copy(perm.begin(), perm.begin() + h.size(), h.begin());
  }
  uint8_t *cache; int *rows; uint8_t *flush;
  cudaMalloc(&cache, (size_t)n_cache * ROW); cudaMemset(cache, 1, (size_t)n_cache * ROW);
  cudaMalloc(&flush, 256 << 20);
  cudaMalloc(&rows, h.size() * 4); cudaMemcpy(rows, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  int max_depth = 0;
  for (int d : depths) max_depth = std::max(max_depth, d);
  cudaFuncSetAttribute(gather<ROW>, cudaFuncAttributeMaxDynamicSharedMemorySize, max_depth * BLK * ROW);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const char *names[] = {"cp.async 16B", "bulk 1 copy/row", "bulk 256 B + rest", "cp.async 16B L2::256B"};
  printf("\n%d-byte rows, %s\n\n", ROW, resident ? "from an L2-resident cache, with repetition, no flush"
                                                 : "all distinct, L2 flushed before each launch");
  printf("| mode | depth (64-row blocks in flight) | us | GB/s total | GB/s per SM |\n|---|---|---|---|---|\n");
  for (int mode = 0; mode < N_MODES; ++mode)
    for (int depth : depths) {
      float best = 1e9;
      for (int it = 0; it < 5; ++it) {
        if (!resident) cudaMemset(flush, it, 256 << 20);
        cudaEventRecord(a);
        gather<ROW><<<sms, 128, depth * BLK * ROW>>>(cache, rows, rows_per_cta, depth, mode);
        cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms);
      }
      cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
      double bytes = (double)sms * rows_per_cta * ROW;
      printf("| %s | %d | %.1f | %.0f | %.1f |\n", names[mode], depth, best * 1e3, bytes / best / 1e6, bytes / best / 1e6 / sms);
    }
  cudaFree(cache); cudaFree(flush); cudaFree(rows);
  return 0;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  // decode: 576-byte MODEL1 rows from a 302 MB cache; prefill: 1024-byte bf16 rows from 8 MB (8192 rows)
  if (run_table<576>(sms, 512 * 1024, 640 * 4, false, {1, 2, 3, 4, 6})) return 1;
  return run_table<1024>(sms, 8192, 640 * 16, true, {1, 2, 3});
}
