/* The error word's reset. The host takes a failure from the mapped word (cuda_take_error), then
 * clears the device word only if it still holds what the host took: a kernel may have replaced it
 * meanwhile with a failure that breaks the buffer (epk_err_claim), which must stay for the next
 * look. One thread, one atomic: a memset could also tear against a concurrent atomicCAS. */
#include "cuda/kernels/common.cuh"

static __global__ void epk_clear_err_kernel(const epk_buf_t b, unsigned long long taken) {
  atomicCAS(&b.priv->err, taken, 0ull);
}

extern "C" cudaError_t epk_launch_clear_err(const epk_buf_t *b, uint64_t taken, cudaStream_t s) {
  epk_clear_err_kernel<<<1, 1, 0, s>>>(*b, (unsigned long long)taken);
  return cudaGetLastError();
}
