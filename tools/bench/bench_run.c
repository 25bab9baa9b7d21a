/* The backend-neutral driver of `epcomm bench` (bench.h): the buffer and where tensors live,
 * rows of results, and the measured loop with its two clocks (the host's around a synchronous
 * call on the CPU backend, CUDA events on the stream on the GPU). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench.h"
#include "bench_gpu.h"
#include "tk_clock.h"
#include "tk_dev.h"

/* ------------------------------------------------------------------ buffer and tensors */

static const char *last_dev_error = "";

const char *bench_dev_error(void) {
  return last_dev_error;
}

/* The GPU of this rank: EP_CUDA_DEVICE, else the local rank modulo the GPUs (what the library
 * would pick), given to the library explicitly so that the bench's tensors live beside it. */
static int pick_device(bench_ctx_t *c, ep_buffer_config_t *cfg) {
  char why[160];
  int n = tk_dev_count(why, sizeof why);
  const char *env = getenv("EP_CUDA_DEVICE"), *local = getenv("EP_LOCAL_RANK");
  if (n <= 0) return fprintf(stderr, "epcomm bench: no GPU: %s\n", why), 1;
  cfg->cuda_device = env && *env ? atoi(env) : (local && *local ? atoi(local) : c->me) % n;
  if (!tk_dev_select(cfg->cuda_device)) return 0;
  fprintf(stderr, "epcomm bench: GPU %d: %s\n", cfg->cuda_device, tk_dev_error());
  return 1;
}

void bench_traffic_step(bench_ctx_t *c, int it, double *net, double *local) {
  if (c->o->nhosts < 2) return;
  ep_buffer_info_t i = EP_BUFFER_INFO_INIT;
  if (ep_buffer_query(c->buf, &i)) return;
  double n = (double)i.net_bytes_sent, l = (double)i.local_bytes_sent, I = c->o->iters;
  if (it >= 0 && net) *net += (n - c->sent_net) / I, *local += (l - c->sent_local) / I;
  c->sent_net = n, c->sent_local = l;
}

ep_buffer_info_t bench_info(bench_ctx_t *c) {
  ep_buffer_info_t i = EP_BUFFER_INFO_INIT;
  if (ep_buffer_query(c->buf, &i)) i = (ep_buffer_info_t)EP_BUFFER_INFO_INIT;
  return i;
}

void bench_path_set(bench_ctx_t *c, bench_path_t *p, uint64_t before, uint64_t after) {
  p->calls = c->o->warmup + c->o->iters;
  p->took = (int32_t)(after - before);
}

int bench_ctx_open(bench_ctx_t *c, ep_buffer_config_t *cfg) {
  const bench_opts_t *o = c->o;
  c->dev = o->backend == BENCH_CUDA;
  cfg->backend = c->dev ? EP_BACKEND_CUDA : EP_BACKEND_CPU;
  if (c->dev)
    cfg->num_sms = o->threads;
  else
    cfg->num_channels = o->threads;
  if (!(c->agree = calloc((size_t)c->R, sizeof *c->agree)))
    return fprintf(stderr, "epcomm bench: out of memory\n"), 1;
  int ok = !(c->dev && pick_device(c, cfg));
  if (ok && c->dev && bgpu_stream_new(&c->stream))
    ok = 0, fprintf(stderr, "epcomm bench: %s\n", bgpu_error());
  /* Agreed: a rank without its GPU would leave its peers in the buffer's creation. */
  if (bench_agree(c, ok, "its GPU and stream")) return 1;
  ep_buffer_info_t info = EP_BUFFER_INFO_INIT;
  TRY(ep_buffer_create(c->g, cfg, &c->buf));
  if (ep_buffer_query(c->buf, &info)) /* local; agreed below with the ceiling */
    fprintf(stderr, "epcomm bench: ep_buffer_query: %s\n", ep_last_error());
  else
    c->caps = info.caps, c->ceiling = bench_ceiling_new(c);
  return bench_agree(c, c->ceiling != NULL, "the copy ceiling"); /* its loop is collective */
fail:
  return 1;
}

void bench_ctx_close(bench_ctx_t *c) {
  if (c->dev) tk_dev_sync(1, c->stream);
  bench_ceiling_free(c, c->ceiling);
  c->ceiling = NULL;
  if (c->buf && ep_buffer_destroy(c->buf))
    fprintf(stderr, "epcomm bench: ep_buffer_destroy: %s\n", ep_last_error());
  c->buf = NULL;
  if (c->stream) bgpu_stream_free(c->stream);
  c->stream = NULL;
  free(c->agree);
  c->agree = NULL;
}

void *bench_alloc(bench_ctx_t *c, size_t n) {
  void *p = tk_dev_alloc(c->dev, n, 0);
  if (!p) fprintf(stderr, "epcomm bench: %s\n", last_dev_error = tk_dev_error());
  return p;
}

void bench_free(bench_ctx_t *c, void *p) {
  tk_dev_free(c->dev, p);
}

int bench_upload(bench_ctx_t *c, void *dst, const void *host, size_t n) {
  if (!tk_dev_upload(c->dev, dst, host, n)) return 0;
  fprintf(stderr, "epcomm bench: %s\n", last_dev_error = tk_dev_error());
  return -1;
}

int bench_copy(bench_ctx_t *c, void *dst, const void *src, size_t n) {
  if (!tk_dev_copy(c->dev, dst, src, n, c->stream)) return 0;
  last_dev_error = tk_dev_error();
  return -1;
}

int bench_sync(bench_ctx_t *c) {
  if (!tk_dev_sync(c->dev, c->stream)) return 0;
  last_dev_error = tk_dev_error();
  return -1;
}

/* Every rank's ok (1 ready; 0 not; AGREE_STOPPED: stopped before, and said why), or 0 with
 * *lost set when the allgather itself failed. */
#define AGREE_STOPPED 2
static int all_ok(bench_ctx_t *c, int ok, int *lost) {
  int every = !(*lost = ep_group_allgather(c->g, &ok, c->agree, sizeof ok) != EP_OK);
  for (int r = 0; every && r < c->R; r++) every = c->agree[r] == 1;
  return every;
}

int bench_all_ok(bench_ctx_t *c, int ok) {
  int lost;
  return all_ok(c, !!ok, &lost);
}

/* EP_BENCH_REFUSE=RANK:TEXT, for tests: rank RANK is not ready at every agreement whose WHAT
 * contains TEXT, so that the path where one rank cannot prepare can be run on purpose. */
static int refused(const bench_ctx_t *c, const char *what) {
  const char *e = c->o->refuse, *text = strchr(e, ':');
  return text && atoi(e) == c->me && strstr(what, text + 1);
}

/* Whether any peer stopped before (AGREE_STOPPED) and none failed here (0). */
static int only_stopped(const bench_ctx_t *c) {
  int stopped = 0;
  for (int r = 0; r < c->R; r++) {
    if (c->agree[r] == 0) return 0;
    stopped |= c->agree[r] == AGREE_STOPPED;
  }
  return stopped;
}

static int agree_as(bench_ctx_t *c, int ok, const char *verb, const char *what) {
  int lost;
  if (ok == 1 && refused(c, what)) ok = 0;
  if (all_ok(c, ok, &lost)) return 0;
  if (lost)
    fprintf(stderr, "epcomm bench: rank %d: agreeing on %s: %s\n", c->me, what, ep_last_error());
  else if (!ok)
    fprintf(stderr, "epcomm bench: rank %d could not %s %s\n", c->me, verb, what);
  else if (c->me == 0 && ok == 1 && only_stopped(c))
    fprintf(stderr, "epcomm bench: another rank stopped before it could %s %s\n", verb, what);
  else if (c->me == 0 && ok == 1)
    fprintf(stderr, "epcomm bench: another rank could not %s %s\n", verb, what);
  return 1;
}

int bench_agree(bench_ctx_t *c, int ok, const char *what) {
  return agree_as(c, !!ok, "prepare", what);
}

int bench_agree_check(bench_ctx_t *c, int stopped, int ok, const char *what) {
  return agree_as(c, stopped ? AGREE_STOPPED : !!ok, "check", what);
}

void *bench_fetch(bench_ctx_t *c, const void *src, size_t n) {
  void *h = bench_sync(c) ? NULL : tk_dev_fetch(c->dev, src, n);
  if (!h) fprintf(stderr, "epcomm bench: %s\n", last_dev_error = tk_dev_error());
  return h;
}

int bench_said(ep_status_t st, const char *call) {
  if (st == EP_OK) return 0;
  fprintf(stderr, "epcomm bench: %s: %s: %s\n", call, ep_status_name(st), ep_last_error());
  return 1;
}

int bench_row(bench_ctx_t *c, const char *key, const char *label, int kind) {
  int group = kind == BENCH_K_COPY ? BENCH_G_CEILING : BENCH_G_EPCOMM;
  if (!strncmp(key, "baseline_", 9)) group = BENCH_G_BASE;
  return bench_row_add(c->res, key, label, kind, group, 0, 0);
}

void bench_main_rows(bench_ctx_t *c, int row[3]) {
  row[0] = bench_row(c, "dispatch", "epcomm dispatch", BENCH_K_DISPATCH);
  row[1] = bench_row(c, "combine", "epcomm combine", BENCH_K_COMBINE);
  row[2] = bench_row(c, "memcpy", c->dev ? "copy ceiling" : "memcpy ceiling", BENCH_K_COPY);
  if (c->ceiling) c->res->row[row[2]].bytes = bench_ceiling_bytes(c->ceiling);
}

void bench_apply_bytes(bench_ctx_t *c, const bench_bytes_t *b) {
  for (int i = 0; i < c->res->nrows; i++) {
    bench_row_t *r = &c->res->row[i];
    if (r->kind == BENCH_K_DISPATCH) r->bytes = b->d_bytes, r->wire = b->d_wire;
    if (r->kind == BENCH_K_COMBINE) r->bytes = b->c_bytes, r->wire = b->c_wire;
  }
}

/* ------------------------------------------------------------------ the measured loop */

typedef struct {
  bench_ctx_t *c;
  const bench_step_t *steps;
  int n;
  bgpu_events_t *ev; /* 2 per step and timed iteration (GPU) */
  double *cpu, *csw; /* per step, sums over the timed iterations (host clock) */
  double *host;      /* [step][iteration]: the host's seconds in a GPU step's call */
} loop_t;

static void usage_now(double *cpu, double *csw) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  *cpu = (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
         (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec;
  *csw = (double)(ru.ru_nvcsw + ru.ru_nivcsw);
}

static int event_clock(const loop_t *l, int k) {
  return l->c->dev && !l->steps[k].host_clock;
}

/* One step of iteration `it`, timed into its row when it has one. */
static int step(loop_t *l, void *state, int k, int it) {
  bench_ctx_t *c = l->c;
  const bench_step_t *s = &l->steps[k];
  int timed = s->row >= 0 && it >= 0, ev = 2 * (it * l->n + k);
  if (s->row >= 0 && !c->dev && ep_group_barrier(c->g)) {
    fprintf(stderr, "epcomm bench: ep_group_barrier: %s\n", ep_last_error());
    return 1;
  }
  double u0[2] = {0, 0}, u1[2] = {0, 0};
  if (timed && event_clock(l, k) && bgpu_record(l->ev, ev, c->stream)) goto gpu_fail;
  if (timed && !c->dev) usage_now(&u0[0], &u0[1]);
  double t0 = tk_now_s();
  if (s->call(c, state, it)) return 1;
  double t1 = tk_now_s();
  if (timed && event_clock(l, k) && bgpu_record(l->ev, ev + 1, c->stream)) goto gpu_fail;
  if (timed && event_clock(l, k)) l->host[(size_t)k * (size_t)c->o->iters + (size_t)it] = t1 - t0;
  if (!timed || event_clock(l, k)) return 0;
  bench_row_times(c->res, s->row)[it] = t1 - t0;
  if (!c->dev) usage_now(&u1[0], &u1[1]), l->cpu[k] += u1[0] - u0[0], l->csw[k] += u1[1] - u0[1];
  return 0;
gpu_fail:
  fprintf(stderr, "epcomm bench: %s\n", bgpu_error());
  return 1;
}

/* After the loop: GPU times from the events, CPU means into the rows. */
static int collect(loop_t *l) {
  bench_ctx_t *c = l->c;
  int I = c->o->iters;
  for (int k = 0; k < l->n; k++) {
    int row = l->steps[k].row;
    if (row < 0) continue;
    if (!c->dev) c->res->row[row].cpu = l->cpu[k] / I, c->res->row[row].csw = l->csw[k] / I;
    if (event_clock(l, k) && I > 0)
      c->res->row[row].host = bench_stats(l->host + (size_t)k * (size_t)I, I).median;
    for (int it = 0; it < I && event_clock(l, k); it++) {
      double s = bgpu_elapsed(l->ev, 2 * (it * l->n + k), 2 * (it * l->n + k) + 1);
      if (s < 0) return fprintf(stderr, "epcomm bench: %s\n", bgpu_error()), 1;
      bench_row_times(c->res, row)[it] = s;
    }
  }
  return 0;
}

int bench_run(bench_ctx_t *c, void *state, const bench_step_t *steps, int n, const char *what) {
  const bench_opts_t *o = c->o;
  loop_t l = {c,
              steps,
              n,
              NULL,
              calloc((size_t)n, sizeof(double)),
              calloc((size_t)n, sizeof(double)),
              calloc((size_t)n * (size_t)(o->iters > 0 ? o->iters : 1), sizeof(double))};
  int rc = 1;
  if (!l.cpu || !l.csw || !l.host) goto out;
  if (c->dev && !(l.ev = bgpu_events_new(2 * n * o->iters))) {
    fprintf(stderr, "epcomm bench: %s\n", bgpu_error());
    goto out;
  }
  bench_progress_stage(o->progress, what, o->warmup + o->iters);
  if (bench_sync(c)) {
    fprintf(stderr, "epcomm bench: before %s: %s\n", what, bench_dev_error());
    goto out;
  }
  if (ep_group_barrier(c->g)) {
    fprintf(stderr, "epcomm bench: before %s: %s\n", what, ep_last_error());
    goto out;
  }
  for (int it = -o->warmup; it < o->iters; it++) {
    bench_progress_step(o->progress, it + o->warmup);
    for (int k = 0; k < n; k++)
      if (step(&l, state, k, it)) goto out;
  }
  rc = bench_sync(c) ? 1 : collect(&l);
out:
  bgpu_events_free(l.ev);
  free(l.cpu), free(l.csw), free(l.host);
  return rc;
}
