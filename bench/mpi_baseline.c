/*
 * epcomm-bench-mpi: the dispatch/combine a CPU user would write without epcomm, on MPI
 * (docs/SEMANTICS.md §9),
 * with the same options, data, checks, statistics and report as `epcomm bench` (ep_benchcore:
 * tools/bench/).
 *
 * dispatch: route (which ranks each token goes to, once per rank), count exchange
 *   (MPI_Allgather of the per-destination counts: every rank learns rank_prefix), pack (one copy
 *   of each token per destination rank, destination-major, token order), MPI_Alltoallv of the
 *   rows and of their metadata (source index, fp8 scales, topk ids and weights), unpack the
 *   metadata (local expert ids, weights, tokens per expert). The rows land grouped by source rank
 *   in token order: epcomm's layout, no further permutation.
 * combine: MPI_Alltoallv of the expert outputs back, then per token the sum in fp32 of its rows in
 *   ascending rank order, rounded once to bf16 (docs/SEMANTICS.md §4.2).
 *
 * Built with -O3 -march=native (see bench/CMakeLists.txt) so that its plain reduction loops
 * vectorise for this machine, as a tuned user's would: the comparison is about moving data, not
 * about an unvectorised loop.
 *
 * Run by `epcomm bench` (which passes --raw FILE and merges the results into its own report) or
 * on its own, with epcomm bench's report (table, --json):
 *   mpirun -n 4 --oversubscribe --bind-to none build/bin/epcomm-bench-mpi [options]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "bench_result.h"
#include "epcomm.h" /* the version macros only: this program never links the library */
#include "tk_num.h"

typedef struct {
  const bench_opts_t *o;
  int R, me, ns, K, per;
  size_t row, meta; /* bytes of a row and of its metadata record */
  /* inputs */
  uint8_t *x;
  float *xs, *w;
  int64_t *idx;
  /* dispatch state */
  uint8_t *in_rank;               /* [N][R] */
  int *scnt, *sdis, *rcnt, *rdis; /* per rank, in rows */
  int *all_cnt;                   /* [R][R] counts from everyone */
  uint8_t *sbuf, *smeta, *rmeta;  /* packed rows and metadata */
  size_t scap, rcap;
  int nr;
  /* outputs */
  uint8_t *rx;
  float *rscales, *rw;
  int64_t *ridx;
  int32_t *rsrc, *prefix, *tpe;
  /* combine */
  uint16_t *y, *cbuf, *out;
  float *acc;
} base_t;

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "epcomm-bench-mpi: out of memory (%zu bytes)\n", n);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  memset(p, 0, n ? n : 1); /* touched now: no iteration pays for page faults */
  return p;
}

static void route(base_t *b) {
  const bench_opts_t *o = b->o;
  memset(b->in_rank, 0, (size_t)o->tokens * b->R);
  memset(b->scnt, 0, (size_t)b->R * sizeof(int));
  for (int t = 0; t < o->tokens; t++)
    for (int k = 0; k < b->K; k++) {
      int64_t e = b->idx[(size_t)t * b->K + k];
      if (e < 0) continue;
      uint8_t *m = &b->in_rank[(size_t)t * b->R + e / b->per];
      if (!*m) *m = 1, b->scnt[e / b->per]++;
    }
}

static void grow(base_t *b, int send_rows, int recv_rows) {
  if ((size_t)send_rows > b->scap) {
    free(b->sbuf), free(b->smeta), free(b->cbuf);
    b->scap = (size_t)send_rows;
    b->sbuf = xmalloc(b->scap * b->row), b->smeta = xmalloc(b->scap * b->meta);
    b->cbuf = xmalloc(b->scap * (size_t)b->o->hidden * 2);
  }
  if ((size_t)recv_rows > b->rcap) {
    free(b->rx), free(b->rmeta), free(b->rscales), free(b->rw), free(b->ridx), free(b->rsrc),
        free(b->y);
    b->rcap = (size_t)recv_rows;
    b->rx = xmalloc(b->rcap * b->row), b->rmeta = xmalloc(b->rcap * b->meta);
    b->rscales = xmalloc(b->rcap * (size_t)b->ns * 4), b->rw = xmalloc(b->rcap * b->K * 4);
    b->ridx = xmalloc(b->rcap * b->K * 8), b->rsrc = xmalloc(b->rcap * 4);
    b->y = xmalloc(b->rcap * (size_t)b->o->hidden * 2);
  }
}

/* Metadata record: int32 source index, int32 pad, scales[ns], ids[K] (int64), weights[K]. */
static void pack(base_t *b) {
  const bench_opts_t *o = b->o;
  int *cur = b->rdis; /* reused as cursors, rebuilt after */
  for (int d = 0; d < b->R; d++) cur[d] = b->sdis[d];
  for (int t = 0; t < o->tokens; t++)
    for (int d = 0; d < b->R; d++) {
      if (!b->in_rank[(size_t)t * b->R + d]) continue;
      size_t j = (size_t)cur[d]++;
      memcpy(b->sbuf + j * b->row, b->x + (size_t)t * b->row, b->row);
      uint8_t *m = b->smeta + j * b->meta;
      int32_t src = t;
      memcpy(m, &src, 4);
      memcpy(m + 8, b->xs + (size_t)t * b->ns, (size_t)b->ns * 4);
      memcpy(m + 8 + b->ns * 4, b->idx + (size_t)t * b->K, (size_t)b->K * 8);
      memcpy(m + 8 + b->ns * 4 + b->K * 8, b->w + (size_t)t * b->K, (size_t)b->K * 4);
    }
}

static void unpack(base_t *b) {
  memset(b->tpe, 0, (size_t)b->per * sizeof *b->tpe);
  int lo = b->me * b->per;
  for (int j = 0; j < b->nr; j++) {
    const uint8_t *m = b->rmeta + (size_t)j * b->meta;
    memcpy(&b->rsrc[j], m, 4);
    memcpy(b->rscales + (size_t)j * b->ns, m + 8, (size_t)b->ns * 4);
    const uint8_t *ids = m + 8 + b->ns * 4, *ws = ids + b->K * 8;
    for (int k = 0; k < b->K; k++) {
      int64_t e;
      float wt;
      memcpy(&e, ids + k * 8, 8);
      memcpy(&wt, ws + k * 4, 4);
      int local = e >= lo && e < lo + b->per;
      b->ridx[(size_t)j * b->K + k] = local ? e - lo : -1;
      b->rw[(size_t)j * b->K + k] = local ? wt : 0.0f;
      if (local) b->tpe[e - lo]++;
    }
  }
}

static void dispatch(base_t *b, MPI_Datatype trow, MPI_Datatype tmeta) {
  int R = b->R;
  route(b);
  MPI_Allgather(b->scnt, R, MPI_INT, b->all_cnt, R, MPI_INT, MPI_COMM_WORLD);
  int ss = 0, rs = 0;
  for (int r = 0; r < R; r++) {
    b->rcnt[r] = b->all_cnt[(size_t)r * R + b->me];
    b->sdis[r] = ss, ss += b->scnt[r];
    for (int d = 0; d < R; d++)
      b->prefix[(size_t)r * R + d] =
          b->all_cnt[(size_t)r * R + d] + (r ? b->prefix[(size_t)(r - 1) * R + d] : 0);
  }
  grow(b, ss, b->prefix[(size_t)(R - 1) * R + b->me]);
  pack(b);
  for (int r = 0; r < R; r++) b->rdis[r] = rs, rs += b->rcnt[r];
  b->nr = rs;
  MPI_Alltoallv(b->sbuf, b->scnt, b->sdis, trow, b->rx, b->rcnt, b->rdis, trow, MPI_COMM_WORLD);
  MPI_Alltoallv(b->smeta, b->scnt, b->sdis, tmeta, b->rmeta, b->rcnt, b->rdis, tmeta,
                MPI_COMM_WORLD);
  unpack(b);
}

static void combine(base_t *b, MPI_Datatype tcomb) {
  const bench_opts_t *o = b->o;
  int R = b->R, H = o->hidden;
  MPI_Alltoallv(b->y, b->rcnt, b->rdis, tcomb, b->cbuf, b->scnt, b->sdis, tcomb, MPI_COMM_WORLD);
  int *cur = calloc((size_t)R, sizeof *cur);
  for (int t = 0; t < o->tokens; t++) {
    float *restrict acc = b->acc;
    for (int h = 0; h < H; h++) acc[h] = 0.0f;
    for (int d = 0; d < R; d++) {
      if (!b->in_rank[(size_t)t * R + d]) continue;
      const uint16_t *restrict row = b->cbuf + (size_t)(b->sdis[d] + cur[d]++) * H;
      for (int h = 0; h < H; h++)
        acc[h] += tk_bf16_to_f32(row[h]); /* inline: the loop vectorises */
    }
    uint16_t *restrict out = b->out + (size_t)t * H;
    for (int h = 0; h < H; h++) out[h] = tk_f32_to_bf16(acc[h]);
  }
  free(cur);
}

static void make_y(base_t *b) {
  for (int s = 0, j = 0; s < b->R; s++)
    for (int n = 0; n < b->rcnt[s]; n++, j++)
      bench_gen_y_row(b->o, b->me, s, b->rsrc[j], b->y + (size_t)j * b->o->hidden);
}

/* This rank's results in epcomm bench's form: the baseline's rows, its check, its digests. */
static bench_rank_t *results(const bench_opts_t *o, base_t *b, long bad, const char *msg,
                             const double *t, double copy_bytes) {
  int I = o->iters;
  bench_rank_t *r = bench_rank_new(I);
  if (!r) return NULL;
  bench_bytes_t by = bench_normal_bytes(o, b->nr, b->rcnt[b->me]);
  bench_row_add(r, "baseline_dispatch", "MPI baseline dispatch", BENCH_K_DISPATCH, BENCH_G_BASE,
                by.d_bytes, by.d_wire);
  bench_row_add(r, "baseline_combine", "MPI baseline combine", BENCH_K_COMBINE, BENCH_G_BASE,
                by.c_bytes, by.c_wire);
  bench_row_add(r, "baseline_memcpy", "memcpy ceiling, MPI run", BENCH_K_COPY, BENCH_G_BASE_CEILING,
                copy_bytes, 0);
  for (int k = 0; k < 3; k++) memcpy(bench_row_times(r, k), t + (size_t)k * I, (size_t)I * 8);
  r->recv_rows = b->nr, r->self_rows = b->rcnt[b->me];
  bench_rank_fail(r, bad, msg);
  r->digest_x = bench_digest(b->rx, (size_t)b->nr * b->row, BENCH_DIGEST_SEED);
  r->digest_rows = r->digest_x;
  if (b->ns) r->digest_x = bench_digest(b->rscales, (size_t)b->nr * b->ns * 4, r->digest_x);
  r->digest_out = bench_digest(b->out, (size_t)o->tokens * o->hidden * 2, BENCH_DIGEST_SEED);
  return r;
}

/* Rank 0: the raw results for epcomm bench to merge (header line, then every rank's packed
 * results), or the report of epcomm bench (table, --json) when run alone. */
static int conclude(const bench_opts_t *o, int R, const char *all, size_t sz) {
  if (o->raw) {
    FILE *f = fopen(o->raw, "we");
    int ok = f && fprintf(f, "epcomm-bench-mpi 3 %d %zu\n", R, sz) > 0 &&
             fwrite(all, 1, sz * (size_t)R, f) == sz * (size_t)R;
    if (f) ok &= fclose(f) == 0;
    if (!ok) fprintf(stderr, "epcomm-bench-mpi: cannot write %s\n", o->raw);
    return ok ? 0 : 2;
  }
  bench_rank_t **rk = calloc((size_t)R, sizeof *rk);
  int rc = rk ? 0 : 2;
  for (int r = 0; !rc && r < R; r++) rc = (rk[r] = bench_rank_unpack(all + sz * r, sz)) ? 0 : 2;
  char version[32];
  snprintf(version, sizeof version, "%d.%d.%d", EP_VERSION_MAJOR, EP_VERSION_MINOR,
           EP_VERSION_PATCH);
  bench_who_t who = {"epcomm-bench-mpi", version, "MPI_Alltoallv baseline alone",
                     bench_usable_cpus()};
  if (!rc) rc = bench_report(o, &who, R, rk, NULL);
  for (int r = 0; rk && r < R; r++) bench_rank_free(rk[r]);
  free(rk);
  return rc;
}

/* Everyone's results to rank 0, which concludes. Returns the exit status (on every rank). */
static int report(const bench_opts_t *o, base_t *b, long bad, const char *msg, const double *t,
                  double copy_bytes) {
  bench_rank_t *r = results(o, b, bad, msg, t, copy_bytes);
  if (!r) MPI_Abort(MPI_COMM_WORLD, 2);
  size_t sz = bench_rank_packed_size(r);
  char *mine = malloc(sz), *all = b->me == 0 ? malloc(sz * (size_t)b->R) : NULL;
  if (!mine || (b->me == 0 && !all)) MPI_Abort(MPI_COMM_WORLD, 2);
  bench_rank_pack(r, mine);
  MPI_Gather(mine, (int)sz, MPI_BYTE, all, (int)sz, MPI_BYTE, 0, MPI_COMM_WORLD);
  int rc = b->me == 0 ? conclude(o, b->R, all, sz) : 0;
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  free(mine), free(all), bench_rank_free(r);
  return rc;
}

static void setup(base_t *b, const bench_opts_t *o, int R, int me) {
  memset(b, 0, sizeof *b);
  b->o = o, b->R = R, b->me = me, b->ns = bench_num_scales(o), b->K = o->topk;
  b->per = o->experts / R;
  b->row = bench_row_bytes(o);
  b->meta = (8 + (size_t)b->ns * 4 + (size_t)b->K * 12 + 7) & ~(size_t)7;
  size_t N = (size_t)o->tokens;
  b->x = xmalloc(N * b->row), b->xs = xmalloc(N * b->ns * 4);
  b->idx = xmalloc(N * b->K * 8), b->w = xmalloc(N * b->K * 4);
  bench_gen_x(o, me, b->x, b->xs);
  bench_gen_route(o, me, b->idx, b->w);
  b->in_rank = xmalloc(N * R);
  b->scnt = xmalloc(R * sizeof(int)), b->sdis = xmalloc(R * sizeof(int));
  b->rcnt = xmalloc(R * sizeof(int)), b->rdis = xmalloc(R * sizeof(int));
  b->all_cnt = xmalloc((size_t)R * R * sizeof(int));
  b->prefix = xmalloc((size_t)R * R * sizeof(int32_t)), b->tpe = xmalloc(b->per * sizeof(int32_t));
  b->out = xmalloc(N * o->hidden * 2), b->acc = xmalloc((size_t)o->hidden * 4);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int R, me;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  bench_opts_t o;
  int rc = bench_parse(argc, argv, "epcomm-bench-mpi", BENCH_TOOL_MPI, &o);
  if (rc) {
    MPI_Finalize();
    return rc == 1 << 8 ? 0 : rc;
  }
  char why[320];
  if (bench_fix_experts(&o, R, why, sizeof why) < 0) {
    if (me == 0) fprintf(stderr, "epcomm-bench-mpi: %s\n", why);
    MPI_Finalize();
    return 2;
  }
  base_t b;
  setup(&b, &o, R, me);
  MPI_Datatype trow, tmeta, tcomb;
  MPI_Type_contiguous((int)b.row, MPI_BYTE, &trow);
  MPI_Type_contiguous((int)b.meta, MPI_BYTE, &tmeta);
  MPI_Type_contiguous(o.hidden * 2, MPI_BYTE, &tcomb);
  MPI_Type_commit(&trow), MPI_Type_commit(&tmeta), MPI_Type_commit(&tcomb);
  double *t = calloc(3 * (size_t)o.iters, sizeof *t);
  /* The same memcpy ceiling as epcomm bench's, one copy per iteration right before the exchange,
   * so that the two runs (one after the other on a shared machine) can be compared relative to
   * each one's own ceiling as well as by raw time. */
  size_t cn = (size_t)128 << 20; /* as tools/bench/bench_ceiling.c */
  unsigned char *csrc = xmalloc(cn), *cdst = xmalloc(cn);
  /* OpenMPI sets up its shared-memory fast paths to a peer only after some traffic (vader: eager
   * buffers after 16 sends): warm the path so that a short run does not time its set-up. */
  for (int i = 0; i < 32; i++) {
    MPI_Alltoall(b.scnt, 1, MPI_INT, b.rcnt, 1, MPI_INT, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  for (int it = -o.warmup; it < o.iters; it++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double tc = MPI_Wtime();
    memcpy(cdst, csrc, cn);
    tc = MPI_Wtime() - tc;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    dispatch(&b, trow, tmeta);
    double t1 = MPI_Wtime();
    if (it == -o.warmup) make_y(&b);
    MPI_Barrier(MPI_COMM_WORLD);
    double t2 = MPI_Wtime();
    combine(&b, tcomb);
    double t3 = MPI_Wtime();
    if (it >= 0) t[it] = t1 - t0, t[o.iters + it] = t3 - t2, t[2 * o.iters + it] = tc;
  }
  char m1[256] = "", m2[256] = "";
  bench_recv_t rv = {b.nr, b.rx, b.rscales, b.ridx, b.rw, b.rsrc, b.prefix, b.tpe};
  long bad = bench_check_dispatch(&o, R, me, &rv, m1, sizeof m1);
  long bad2 = bench_check_combine(&o, R, me, b.out, m2, sizeof m2);
  int ok = !bad && !bad2, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  rc = report(&o, &b, bad + bad2, bad ? m1 : m2, t, (double)cn);
  MPI_Type_free(&trow), MPI_Type_free(&tmeta), MPI_Type_free(&tcomb);
  free(t), free(csrc), free(cdst);
  MPI_Finalize();
  return rc ? rc : all_ok ? 0 : 1;
}
