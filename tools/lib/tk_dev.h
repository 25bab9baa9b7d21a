/* Tensor memory for programs that run on either backend: device memory (CUDA runtime) when
 * `dev` is set, host memory otherwise, so that one body of code drives both (tests with
 * EP_BACKEND=cuda, `epcomm bench --backend cuda`). Without a CUDA build, device requests fail
 * with a message. Errors: NULL or -1, and tk_dev_error() says why (per thread). */
#ifndef EP_TK_DEV_H
#define EP_TK_DEV_H

#include <stddef.h>

/* How many GPUs this process sees; 0 with the reason in why[n] (not built, no driver, none). */
int tk_dev_count(char *why, size_t n);
/* Makes device `index` current for this thread (dev only). */
int tk_dev_select(int index);

/* n bytes (at least 1), every byte set to `fill`: host memory 64-byte aligned, as a framework's
 * tensors are, and touched, so that no timed call pays for page faults. */
void *tk_dev_alloc(int dev, size_t n, int fill);
void tk_dev_free(int dev, void *p); /* NULL-safe */
/* n bytes of host memory the device can write through the same address (page-locked,
 * cudaHostAlloc) when `dev` is set, plain host memory otherwise; every byte set to `fill`. */
void *tk_dev_pinned_alloc(int dev, size_t n, int fill);
void tk_dev_pinned_free(int dev, void *p); /* NULL-safe */
/* Copies; `stream` (a cudaStream_t, NULL: the default stream) orders device copies, which are
 * asynchronous to the host for device-to-device and synchronous otherwise. */
int tk_dev_upload(int dev, void *dst, const void *host, size_t n);
int tk_dev_download(int dev, void *host, const void *src, size_t n);
int tk_dev_copy(int dev, void *dst, const void *src, size_t n, void *stream);
/* A new host copy of n device bytes (malloc; free it), or NULL. */
void *tk_dev_fetch(int dev, const void *src, size_t n);
/* Waits for the stream's work (NULL: the whole device). */
int tk_dev_sync(int dev, void *stream);
const char *tk_dev_error(void);

#endif
