/* What `epcomm bench` needs of CUDA itself, behind a C interface: streams and events (GPU time),
 * the copy kernel of the ceiling, the compute kernel of the overlap measurement, graph capture,
 * and the pieces of the cudaMemcpy baseline (IPC mappings, its count and pack kernels).
 * bench_gpu.cu implements it when the CUDA backend is built; bench_gpu_none.c otherwise, where
 * every call fails with "not built" (the bench refuses --backend cuda before calling any).
 * Returns: 0 or -1 (bgpu_error() says why); pointers: NULL on failure. Streams are cudaStream_t,
 * passed as void *. */
#ifndef EP_TOOLS_BENCH_GPU_H
#define EP_TOOLS_BENCH_GPU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" { /* bench_gpu.cu defines them */
#endif

const char *bgpu_error(void);

int bgpu_stream_new(void **stream); /* non-blocking: never waits on the legacy default stream */
void bgpu_stream_free(void *stream);

/* n events; elapsed time between two recorded ones in seconds (< 0: failure). */
typedef struct bgpu_events bgpu_events_t;
bgpu_events_t *bgpu_events_new(int n);
void bgpu_events_free(bgpu_events_t *e); /* NULL-safe */
int bgpu_record(bgpu_events_t *e, int i, void *stream);
double bgpu_elapsed(bgpu_events_t *e, int from, int to);

/* Device-to-device copy of n bytes (a multiple of 16, 16-byte aligned) by a grid-stride kernel
 * over every SM: the ceiling that delivered bytes are compared with. */
int bgpu_copy(void *dst, const void *src, size_t n, void *stream);

/* Blocks of rows in one kernel: for each l < nblk, the first count[l] rows (row bytes, a
 * multiple of 16) of block l (block bytes apart, 16-byte aligned) from src to dst; count is
 * device memory. What the low-latency variants write as the experts' outputs before a combine:
 * one launch, where a cudaMemcpyAsync per expert was 144 operations per call at R = 2. */
int bgpu_copy_rows(void *dst, const void *src, const int32_t *count, int nblk, size_t block,
                   size_t row, void *stream);

/* The caller's compute between the two phases: an FMA loop over every SM, `iters` long. */
int bgpu_burn(float *sink, int iters, void *stream);

/* Capture of the calls issued on `stream` between begin and end into a replayable graph. */
int bgpu_capture_begin(void *stream);
int bgpu_capture_end(void *stream, void **graph);
int bgpu_graph_launch(void *graph, void *stream);
void bgpu_graph_free(void *graph); /* NULL-safe */

/* IPC: a handle (BGPU_IPC_BYTES) of device memory for another process to map. */
#define BGPU_IPC_BYTES 64
int bgpu_ipc_get(void *ptr, void *handle);
int bgpu_ipc_open(const void *handle, void **ptr);
void bgpu_ipc_close(void *ptr);

/* The cudaMemcpy baseline. Count: pos[t][d] = rank of token t among the tokens going to rank d
 * (-1: not going), in token order; counts[d] on the host when the call returns. Pack: the rows
 * grouped by destination at off[d] (host array of R), in token order. dev_scratch: 2 x R ints. */
int bgpu_base_count(const int64_t *idx, int N, int topk, int L, int R, int *pos, int *dev_scratch,
                    int *counts, void *stream);
int bgpu_base_pack(const void *x, int N, int R, size_t row, const int *pos, int *dev_scratch,
                   const int *off, void *send, void *stream);

#ifdef __cplusplus
}
#endif

#endif
