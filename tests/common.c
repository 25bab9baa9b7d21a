#include "common.h"

#include <errno.h>
#include <unistd.h>

#include "tk_dev.h"
#include "tk_num.h"

int t_rank = -1;
const char *t_case = NULL;

uint16_t t_rand_bf16(t_rng *r) {
  return tk_f32_to_bf16((t_unit(r) - 0.5f) * 8.0f);
}

void *t_xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) T_FAILF("out of memory (%zu bytes)", n);
  memset(p, T_POISON, n ? n : 1);
  return p;
}

void t_init(ep_group_t *g, int *rank, int *nranks) {
  T_OK(ep_group_create_from_env(NULL, g));
  T_OK(ep_group_rank(*g, rank));
  T_OK(ep_group_nranks(*g, nranks));
  t_rank = *rank;
}

void t_fini(ep_group_t g) {
  T_OK(ep_group_destroy(g));
}

void t_hosts(ep_group_t g, int *nhosts, int **host_of) {
  ep_group_info_t i = EP_GROUP_INFO_INIT;
  T_OK(ep_group_query(g, &i));
  *nhosts = i.nhosts;
  *host_of = t_xmalloc((size_t)i.nranks * sizeof(int));
  T_OK(ep_group_allgather(g, &i.host, *host_of, sizeof(int)));
}

bool t_cuda(void) {
  const char *b = getenv("EP_BACKEND");
  return b && !strcmp(b, "cuda");
}

/* A CUDA backend switch as the library reads it: unset = its default, else on unless 0. */
static bool cuda_switch(const char *name, bool dflt) {
  const char *v = getenv(name);
  return t_cuda() && (v ? atol(v) != 0 : dflt);
}

bool t_late_hello(void) {
  return cuda_switch("EP_CUDA_LATE_HELLO", true);
}

bool t_early_data(void) {
  return cuda_switch("EP_CUDA_EARLY_DATA", false);
}

bool t_pull(void) {
  return cuda_switch("EP_CUDA_PULL", true);
}

bool t_combine_copy(void) {
  return cuda_switch("EP_CUDA_COMBINE_COPY", true);
}

void t_require_backend(void) {
  char why[160];
  if (!t_cuda() || tk_dev_count(why, sizeof why) > 0) return;
  printf("skipped: no GPU (%s)\n", why);
  fflush(stdout);
  exit(T_SKIP);
}

/* A device helper that must succeed. */
#define T_DEV(call)                                 \
  do {                                              \
    if ((call) != 0) T_FAILF("%s", tk_dev_error()); \
  } while (0)

void *t_dalloc(size_t n) {
  if (!t_cuda()) return t_xmalloc(n); /* exact size: ASan sees any overrun */
  void *p = tk_dev_alloc(1, n, T_POISON);
  if (!p) T_FAILF("%s", tk_dev_error());
  return p;
}

void t_copy_to_dev(void *dev, const void *host, size_t n) {
  T_DEV(tk_dev_upload(t_cuda(), dev, host, n));
}

void *t_to_dev(const void *host, size_t n) {
  if (!host) return NULL;
  void *d = t_dalloc(n);
  t_copy_to_dev(d, host, n);
  return d;
}

void *t_to_host(const void *dev, size_t n) {
  void *h = t_xmalloc(n);
  if (n && dev) T_DEV(tk_dev_download(t_cuda(), h, dev, n));
  return h;
}

void t_dfree(void *dev) {
  if (t_cuda())
    tk_dev_free(1, dev);
  else
    free(dev);
}

void *t_pinned_alloc(size_t n) {
  void *p = tk_dev_pinned_alloc(t_cuda(), n, T_POISON);
  if (!p) T_FAILF("%s", tk_dev_error());
  return p;
}

void t_pinned_free(void *p) {
  tk_dev_pinned_free(t_cuda(), p);
}

void t_dsync(void) {
  T_DEV(tk_dev_sync(t_cuda(), NULL));
}

int t_wait_step(void *ctx, int step) {
  t_steps_t *w = ctx;
  w->out_of_order += step != w->steps;
  return ++w->steps < w->want;
}

void t_log_to_file(void) {
  char log[64];
  snprintf(log, sizeof log, "/tmp/epcomm-test-log-%d.log", (int)getpid());
  setenv("EP_LOG_FILE", log, 1);
}

bool t_logged(const char *needle) {
  const char *path = getenv("EP_LOG_FILE");
  if (!path) T_FAILF("t_logged: EP_LOG_FILE is not set (call t_log_to_file first)");
  FILE *f = fopen(path, "r");
  char line[1024];
  bool hit = false;
  while (f && fgets(line, sizeof line, f)) {
    bool this = strstr(line, needle) != NULL;
    if (!this) fputs(line, stderr);
    hit |= this;
  }
  if (f) fclose(f);
  if (truncate(path, 0) != 0 && errno != ENOENT) T_FAILF("truncate %s: %s", path, strerror(errno));
  return hit;
}

void t_log_remove(void) {
  const char *path = getenv("EP_LOG_FILE");
  if (!path) return;
  FILE *f = fopen(path, "r"); /* what nobody read is a warning the test did not expect: shown */
  char line[1024];
  while (f && fgets(line, sizeof line, f)) fputs(line, stderr);
  if (f) fclose(f);
  unlink(path);
}
