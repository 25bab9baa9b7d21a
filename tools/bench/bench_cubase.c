/* The flat baseline of the GPU (`--baseline`, normal mode): what a CUDA user would write without
 * epcomm. Count exchange through the host (a count kernel, the counts to the host, an
 * allgather), a pack kernel (rows grouped by destination, in token order), then the rows to each
 * peer: on one host one cudaMemcpyAsync per peer into its receive buffer mapped by CUDA IPC and a
 * barrier; across hosts (--hosts) one grouped ncclSend/ncclRecv over every rank, as a cluster
 * user writes it (bench_nccl.c). The rows land grouped by source in token order, epcomm's
 * layout. Rows only (no scales or metadata). Timed by the host clock (the call waits for its
 * copies); its received rows are checked against the generator and against epcomm's. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_gpu.h"
#include "bench_nccl.h"
#include "bench_normal.h"

typedef struct {
  normal_t *u;
  int *pos, *scratch;      /* device: [N][R] positions; 2 x R ints for the kernels */
  char *send, *recv;       /* device: [N x R rows] each */
  char **peer;             /* [R] the peers' recv, mapped */
  int *counts, *all, *off; /* host: [R] this rank's counts, [R][R] everyone's, [R] offsets */
  bnccl_t *nccl;           /* across hosts: the rows go through NCCL, not IPC */
  const char **sp;         /* NCCL: [R] send pointers, [R] receive pointers, their bytes */
  char **rp;
  size_t *sb, *rb;
  int mapped; /* map_peers got past its agreement: unmap's barrier is owed */
} base_t;

/* Across hosts: this rank's rows to every rank in one grouped send/receive. */
static int nccl_rows(bench_ctx_t *c, base_t *b) {
  normal_t *u = b->u;
  int R = u->R;
  size_t at = 0;
  for (int q = 0; q < R; q++) {
    b->sp[q] = b->send + (size_t)b->off[q] * u->row;
    b->sb[q] = (size_t)b->counts[q] * u->row;
    b->rp[q] = b->recv + at * u->row;
    b->rb[q] = (size_t)b->all[q * R + u->me] * u->row;
    at += (size_t)b->all[q * R + u->me];
  }
  char why[256];
  bnccl_xfer_t x = {b->sp, b->rp, b->sb, b->rb};
  if (bnccl_exchange(b->nccl, &x, R, c->stream, why, sizeof why)) {
    fprintf(stderr, "epcomm bench: the NCCL baseline: %s\n", why);
    return 1;
  }
  return 0;
}

static int call_base(bench_ctx_t *c, void *state, int it) {
  base_t *b = state;
  normal_t *u = b->u;
  int R = u->R, N = (int)u->N;
  if (bgpu_base_count(u->idx, N, (int)u->K, c->o->experts / R, R, b->pos, b->scratch, b->counts,
                      c->stream))
    goto gpu_fail;
  TRY(ep_group_allgather(c->g, b->counts, b->all, (size_t)R * sizeof(int)));
  for (int d = 0, run = 0; d < R; d++) b->off[d] = run, run += b->counts[d];
  if (bgpu_base_pack(u->x, N, R, u->row, b->pos, b->scratch, b->off, b->send, c->stream))
    goto gpu_fail;
  if (b->nccl) {
    if (nccl_rows(c, b)) return 1;
    if (bench_sync(c)) goto dev_fail;
    return 0;
  }
  for (int d = 0; d < R; d++) {
    size_t at = 0;
    for (int q = 0; q < u->me; q++) at += (size_t)b->all[q * R + d];
    if (bench_copy(c, b->peer[d] + at * u->row, b->send + (size_t)b->off[d] * u->row,
                   (size_t)b->counts[d] * u->row))
      goto dev_fail;
  }
  if (bench_sync(c)) goto dev_fail;
  TRY(ep_group_barrier(c->g));
  return 0;
gpu_fail:
  fprintf(stderr, "epcomm bench: the cudaMemcpy baseline: %s\n", bgpu_error());
  return 1;
dev_fail:
  fprintf(stderr, "epcomm bench: the cudaMemcpy baseline: %s\n", bench_dev_error());
fail:
  return 1;
}

/* Every rank's receive buffer mapped into every other rank. */
static int map_peers(base_t *b) {
  bench_ctx_t *c = b->u->c;
  char mine[BGPU_IPC_BYTES], *all = malloc((size_t)c->R * BGPU_IPC_BYTES);
  const char *why = !all ? "out of memory" : bgpu_ipc_get(b->recv, mine) ? bgpu_error() : NULL;
  if (why) fprintf(stderr, "epcomm bench: the cudaMemcpy baseline: %s\n", why);
  if (bench_agree(c, !why, "the cudaMemcpy baseline's buffer")) return free(all), 1;
  if (ep_group_allgather(c->g, mine, all, BGPU_IPC_BYTES)) why = ep_last_error();
  for (int r = 0; !why && r < c->R; r++)
    if (r == c->me)
      b->peer[r] = b->recv;
    else if (bgpu_ipc_open(all + (size_t)r * BGPU_IPC_BYTES, (void **)&b->peer[r]))
      why = bgpu_error(); /* the failing call's own error, said once */
  if (why) fprintf(stderr, "epcomm bench: the cudaMemcpy baseline: %s\n", why);
  free(all);
  b->mapped = 1; /* unmap closes what was opened; the loop runs only if all was, everywhere */
  return bench_agree(c, !why, "the peers' mapped buffers");
}

/* Its rows against the generator, and against epcomm's main dispatch (same layout). */
static int check(base_t *b) {
  normal_t *u = b->u;
  bench_ctx_t *c = u->c;
  int nr = 0;
  for (int q = 0; q < u->R; q++) nr += b->all[q * u->R + u->me];
  void *x = bench_fetch(c, b->recv, (size_t)nr * u->row);
  if (!x) return 1;
  bench_recv_t rv = {nr, x, NULL, NULL, NULL, NULL, NULL, NULL};
  c->res->base_ran = 1;
  c->res->base_bad = bench_check_dispatch(c->o, u->R, u->me, &rv, c->res->base_msg, BENCH_MSG);
  c->res->base_differs =
      nr != u->nr || bench_digest(x, (size_t)nr * u->row, BENCH_DIGEST_SEED) != u->digest_rows;
  free(x);
  return 0;
}

static void unmap(base_t *b) {
  bench_ctx_t *c = b->u->c;
  for (int r = 0; b->peer && r < c->R; r++)
    if (r != c->me && b->peer[r]) bgpu_ipc_close(b->peer[r]);
  if (ep_group_barrier(c->g)) /* no rank frees its buffer while a peer still maps it */
    fprintf(stderr, "epcomm bench: ep_group_barrier: %s\n", ep_last_error());
}

/* Across hosts: a communicator over every rank, and room for one call's pointers. Each step is
 * agreed, so that a rank that failed on its own (memory, the library, NCCL's init) stops every
 * rank, none left waiting in the next collective call. */
static int open_nccl(base_t *b) {
  bench_ctx_t *c = b->u->c;
  char why[256] = "";
  size_t R = (size_t)c->R;
  b->sp = calloc(R, sizeof *b->sp), b->rp = calloc(R, sizeof *b->rp);
  b->sb = calloc(R, sizeof *b->sb), b->rb = calloc(R, sizeof *b->rb);
  if (bench_agree(c, b->sp && b->rp && b->sb && b->rb, "the NCCL baseline's arrays")) return 1;
  /* Half the group's deadline: a rank whose NCCL init failed at once waits for its peers in
   * the agreement below, while they wait in NCCL's init for it until this one. */
  b->nccl = bnccl_new(c->R, c->o->timeout_s / 2, why, sizeof why);
  if (!b->nccl) fprintf(stderr, "epcomm bench: the NCCL baseline: %s\n", why);
  if (bench_agree(c, b->nccl != NULL, "NCCL for the baseline")) return 1;
  int ok = bnccl_connect(b->nccl, c->g, c->R, c->me, why, sizeof why) == 0;
  if (!ok && *why) fprintf(stderr, "epcomm bench: the NCCL baseline: %s\n", why);
  return bench_agree(c, ok, "the NCCL baseline's communicator");
}

int bench_cubase(normal_t *u) {
  bench_ctx_t *c = u->c;
  int R = u->R;
  size_t rows = u->N * (size_t)R;
  base_t b = {u,
              bench_alloc(c, rows * sizeof(int)),
              bench_alloc(c, 2 * (size_t)R * sizeof(int)),
              bench_alloc(c, rows * u->row),
              bench_alloc(c, rows * u->row),
              calloc((size_t)R, sizeof(char *)),
              calloc((size_t)R, sizeof(int)),
              calloc((size_t)R * R, sizeof(int)),
              calloc((size_t)R, sizeof(int)),
              NULL,
              NULL,
              NULL,
              NULL,
              NULL,
              0};
  int rc = !b.pos || !b.scratch || !b.send || !b.recv || !b.peer || !b.counts || !b.all || !b.off;
  rc = bench_agree(c, !rc, "the baseline's memory"); /* the setup below is collective */
  bool net = c->o->nhosts > 1;
  if (!rc && net)
    rc = open_nccl(&b);
  else if (!rc)
    rc = map_peers(&b);
  const char *name = net ? "NCCL baseline dispatch" : "cudaMemcpy baseline dispatch";
  bench_step_t s[] = {{call_base, bench_row(c, "baseline_dispatch", name, BENCH_K_DISPATCH), 1}};
  if (!rc) { /* agreed whatever happened here: unmap's barrier and epcomm's rows come next */
    rc = bench_run(c, &b, s, 1, net ? "the NCCL baseline" : "the cudaMemcpy baseline");
    rc = bench_agree_check(c, rc, rc || !check(&b), "the baseline's received rows");
  }
  if (b.mapped) unmap(&b);
  bnccl_close(b.nccl, !rc); /* rc is agreed: every rank closes the same way */
  free(b.sp), free(b.rp), free(b.sb), free(b.rb);
  bench_free(c, b.pos), bench_free(c, b.scratch), bench_free(c, b.send), bench_free(c, b.recv);
  free(b.peer), free(b.counts), free(b.all), free(b.off);
  return rc;
}
