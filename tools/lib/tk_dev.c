/* See tk_dev.h. The CUDA runtime's C API: this file is C, built with EP_HAVE_CUDA and the
 * toolkit's include path when the CUDA backend is. */
#include "tk_dev.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef EP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static _Thread_local char last[256];

const char *tk_dev_error(void) {
  return last;
}

static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last, sizeof last, fmt, ap);
  va_end(ap);
  return -1;
}

#ifdef EP_HAVE_CUDA
/* A CUDA call that must succeed: on failure the function returns -1 with the message. */
#define DEV(call)                                                                \
  do {                                                                           \
    cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess) return fail("%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)
#else
#define NOT_BUILT() fail("device memory: this build has no CUDA (configure with -DEP_CUDA=ON)")
#endif

int tk_dev_count(char *why, size_t n) {
#ifdef EP_HAVE_CUDA
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess && count > 0) return count;
  snprintf(why, n, "%s", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
#else
  snprintf(why, n, "the CUDA backend is not built");
#endif
  return 0;
}

int tk_dev_select(int index) {
#ifdef EP_HAVE_CUDA
  DEV(cudaSetDevice(index));
  return 0;
#else
  (void)index;
  return NOT_BUILT();
#endif
}

static void *host_alloc(size_t n, int fill) {
  void *p = NULL;
  if (posix_memalign(&p, 64, n ? n : 1)) return fail("out of memory (%zu bytes)", n), NULL;
  memset(p, fill, n ? n : 1);
  return p;
}

void *tk_dev_alloc(int dev, size_t n, int fill) {
  if (!dev) return host_alloc(n, fill);
#ifdef EP_HAVE_CUDA
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, n ? n : 1);
  if (e == cudaSuccess) e = cudaMemset(p, fill, n ? n : 1);
  if (e == cudaSuccess) return p;
  if (p) cudaFree(p);
  fail("cudaMalloc(%zu bytes): %s", n, cudaGetErrorString(e));
#else
  NOT_BUILT();
#endif
  return NULL;
}

void tk_dev_free(int dev, void *p) {
  if (!p) return;
  if (!dev) return free(p);
#ifdef EP_HAVE_CUDA
  cudaFree(p);
#endif
}

void *tk_dev_pinned_alloc(int dev, size_t n, int fill) {
  if (!dev) return host_alloc(n, fill);
#ifdef EP_HAVE_CUDA
  void *p = NULL;
  cudaError_t e = cudaHostAlloc(&p, n ? n : 1, cudaHostAllocPortable | cudaHostAllocMapped);
  if (e == cudaSuccess) return memset(p, fill, n ? n : 1);
  fail("cudaHostAlloc(%zu bytes): %s", n, cudaGetErrorString(e));
#else
  NOT_BUILT();
#endif
  return NULL;
}

void tk_dev_pinned_free(int dev, void *p) {
  if (!p) return;
  if (!dev) return free(p);
#ifdef EP_HAVE_CUDA
  cudaFreeHost(p);
#endif
}

#ifdef EP_HAVE_CUDA
static int dev_copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, void *stream) {
  if (kind == cudaMemcpyDeviceToDevice)
    DEV(cudaMemcpyAsync(dst, src, n, kind, (cudaStream_t)stream));
  else
    DEV(cudaMemcpy(dst, src, n, kind));
  return 0;
}
#endif

static int copy(int dev, void *dst, const void *src, size_t n, int kind, void *stream) {
  if (!n) return 0;
  if (!dev) return memcpy(dst, src, n), 0;
#ifdef EP_HAVE_CUDA
  static const enum cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                              cudaMemcpyDeviceToDevice};
  return dev_copy(dst, src, n, kinds[kind], stream);
#else
  (void)kind, (void)stream;
  return NOT_BUILT();
#endif
}

int tk_dev_upload(int dev, void *dst, const void *host, size_t n) {
  return copy(dev, dst, host, n, 0, NULL);
}

int tk_dev_download(int dev, void *host, const void *src, size_t n) {
  return copy(dev, host, src, n, 1, NULL);
}

int tk_dev_copy(int dev, void *dst, const void *src, size_t n, void *stream) {
  return copy(dev, dst, src, n, 2, stream);
}

void *tk_dev_fetch(int dev, const void *src, size_t n) {
  void *h = malloc(n ? n : 1);
  if (!h) return fail("out of memory (%zu bytes)", n), NULL;
  if (tk_dev_download(dev, h, src, n)) return free(h), NULL;
  return h;
}

int tk_dev_sync(int dev, void *stream) {
  if (!dev) return 0;
#ifdef EP_HAVE_CUDA
  if (stream)
    DEV(cudaStreamSynchronize((cudaStream_t)stream));
  else
    DEV(cudaDeviceSynchronize());
  return 0;
#else
  (void)stream;
  return NOT_BUILT();
#endif
}
