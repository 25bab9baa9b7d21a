/* bench_gpu.h without CUDA: every call fails. `epcomm bench --backend cuda` says "skipped: no GPU"
 * before it would call any of these; they exist so that the driver has no #ifdef. */
#include "bench_gpu.h"

const char *bgpu_error(void) {
  return "this build has no CUDA backend (configure with -DEP_CUDA=ON)";
}
int bgpu_stream_new(void **stream) {
  return *stream = 0, -1;
}
void bgpu_stream_free(void *stream) {}
bgpu_events_t *bgpu_events_new(int n) {
  return 0;
}
void bgpu_events_free(bgpu_events_t *e) {}
int bgpu_record(bgpu_events_t *e, int i, void *stream) {
  return -1;
}
double bgpu_elapsed(bgpu_events_t *e, int from, int to) {
  return -1;
}
int bgpu_copy(void *dst, const void *src, size_t n, void *stream) {
  return -1;
}
int bgpu_copy_rows(void *dst, const void *src, const int32_t *count, int nblk, size_t block,
                   size_t row, void *stream) {
  return -1;
}
int bgpu_burn(float *sink, int iters, void *stream) {
  return -1;
}
int bgpu_capture_begin(void *stream) {
  return -1;
}
int bgpu_capture_end(void *stream, void **graph) {
  return *graph = 0, -1;
}
int bgpu_graph_launch(void *graph, void *stream) {
  return -1;
}
void bgpu_graph_free(void *graph) {}
int bgpu_ipc_get(void *ptr, void *handle) {
  return -1;
}
int bgpu_ipc_open(const void *handle, void **ptr) {
  return *ptr = 0, -1;
}
void bgpu_ipc_close(void *ptr) {}
int bgpu_base_count(const int64_t *idx, int N, int topk, int L, int R, int *pos, int *dev_scratch,
                    int *counts, void *stream) {
  return -1;
}
int bgpu_base_pack(const void *x, int N, int R, size_t row, const int *pos, int *dev_scratch,
                   const int *off, void *send, void *stream) {
  return -1;
}
