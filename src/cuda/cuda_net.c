/* The CUDA backend across hosts: state, staging, the count exchange, waits (cuda_net.h). */
#include "cuda/cuda_net.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char OP[] = "ep_buffer_create";

const char *cuda_net_who(const cuda_state_t *s, int rank, char *buf, size_t n) {
  return ep_ctx_who(s->ctx, rank, buf, n);
}

/* Local ranks' areas D and C as mapped here, in a device table indexed by local index. */
static ep_status_t area_tables(cuda_state_t *s) {
  cuda_net_t *n = s->net;
  size_t L = (size_t)n->L, R = (size_t)s->nranks;
  uint8_t *tab[2 * L];
  for (size_t l = 0; l < L; l++) {
    uint8_t *pool = s->peer_ptrs[n->rank_at[(size_t)n->host * L + l]];
    tab[l] = pool + s->kb.off_area_d;
    tab[L + l] = pool + s->kb.off_area_c;
  }
  int32_t hof[R];
  for (size_t r = 0; r < R; r++) hof[r] = n->host_of[r];
  void *m = NULL;
  size_t bytes = epk_al(2 * L * sizeof(void *), 256) + epk_al(4 * R, 256) + 16;
  ep_status_t st = cuda_check(s, cudaMalloc(&m, bytes), OP, "network tables");
  if (st) return st;
  n->area_d = m;
  n->area_c = (uint8_t **)m + L;
  n->host_of_dev = (int32_t *)((uint8_t *)m + epk_al(2 * L * sizeof(void *), 256));
  n->bad = (int32_t *)((uint8_t *)n->host_of_dev + epk_al(4 * R, 256));
  if ((st = cuda_check(s, cudaMemcpy(m, tab, sizeof tab, cudaMemcpyHostToDevice), OP,
                       "network tables")))
    return st;
  return cuda_check(s, cudaMemcpy(n->host_of_dev, hof, 4 * R, cudaMemcpyHostToDevice), OP,
                    "network tables");
}

ep_status_t cuda_net_create(cuda_state_t *s, const ep_buffer_config_t *cfg) {
  const ep_topo_t *t = ep_ctx_topo(s->ctx);
  (void)cfg;
  cuda_net_t *n = calloc(1, sizeof *n);
  if (!n) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "init", "out of memory");
  s->net = n;
  n->H = t->nhosts, n->L = t->local_size, n->host = t->host, n->lrank = t->local_rank;
  n->rank_at = t->rank_at, n->host_of = t->host_of, n->local_of = t->local_of;
  n->cw = (int)(sizeof(ep_call_key_t) / 4) + s->nranks + 2 * n->H;
  n->counts = calloc((size_t)s->nranks * (size_t)n->cw, sizeof *n->counts);
  if (!n->counts) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "init", "out of memory");
  /* Collective on every rank alike, after the pools are mapped (cuda_mem_setup agreed). */
  ep_status_t st = ep_ctx_net_open(s->ctx, "mpi", -1, &n->me, &n->ctl);
  if (st) return ep_ctx_fail(s->ctx, st, -1, OP, "network", "%s", ep_ctx_last_error());
  if ((st = cuda_net_agree(s, area_tables(s), OP, "init"))) return st;
  /* NCCL must load on every rank before any rank waits in its communicator's creation. */
  const struct ep_net_engine *nccl = ep_net_find("nccl");
  st = nccl ? nccl->probe() : EP_ERR_UNSUPPORTED;
  if (st)
    st = ep_ctx_fail(s->ctx, st, -1, OP, "network",
                     "the cuda backend across hosts needs NCCL: %s (EP_NCCL_LIB names the library)",
                     ep_ctx_last_error());
  if ((st = cuda_net_agree(s, st, OP, "network"))) return st;
  st = ep_ctx_net_open(s->ctx, "nccl", s->device, &n->e, &n->ep);
  if (st) return ep_ctx_fail(s->ctx, st, -1, OP, "network", "%s", ep_ctx_last_error());
  return s->ll ? cuda_net_agree(s, cuda_net_ll_create(s), OP, "init") : EP_OK;
}

static void dfree(cuda_dstage_t *d) {
  if (d->p) cudaFree(d->p);
  d->p = NULL, d->cap = 0;
}

void cuda_net_destroy(cuda_state_t *s, bool clean) {
  cuda_net_t *n = s->net;
  if (!n) return;
  bool calm = clean && !ep_ctx_peer_lost(s->ctx);
  /* Transfers in flight end first (completed, or let go), then the engines close (NCCL aborts
   * what still runs when not calm), and only then is the memory they wrote into freed. */
  calm = cuda_net_ll_settle_all(s, calm);
  if (n->ep) n->e->close(n->ep, calm);
  if (n->ctl) n->me->close(n->ctl, calm);
  cuda_net_ll_destroy(s);
  dfree(&n->send), dfree(&n->recv), dfree(&n->part), dfree(&n->pin), dfree(&n->desc);
  if (n->area_d) cudaFree(n->area_d);
  if (n->ids_host) cudaFreeHost(n->ids_host);
  free(n->counts);
  free(n);
  s->net = NULL;
}

void cuda_net_traffic(void *state, uint64_t *net, uint64_t *local) {
  cuda_state_t *s = state;
  *net = s->net ? __atomic_load_n(&s->net->net_bytes, __ATOMIC_RELAXED) : 0;
  *local = s->net ? __atomic_load_n(&s->net->local_bytes, __ATOMIC_RELAXED) : 0;
}

/* Growth frees the old memory: every call waits for its stream before it plans (fence), so
 * nothing of an earlier call still uses it. */
void *cuda_dstage(cuda_state_t *s, cuda_dstage_t *d, size_t bytes, const char *op) {
  if (bytes <= d->cap && d->p) return d->p;
  size_t cap = bytes + bytes / 4 + 4096;
  dfree(d);
  if (cudaMalloc((void **)&d->p, cap) != cudaSuccess) {
    cudaGetLastError();
    d->p = NULL;
    ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, op, "network",
                "out of device memory for %zu bytes of network staging", bytes);
    return NULL;
  }
  d->cap = cap;
  return d->p;
}

/* Waits for the stream's work with the buffer's deadline (an event, polled). */
ep_status_t cuda_net_sync(cuda_state_t *s, cudaStream_t st, const char *op, const char *phase) {
  cudaEvent_t ev;
  ep_status_t rc = cuda_check(s, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), op, phase);
  if (rc) return rc;
  rc = cuda_check(s, cudaEventRecord(ev, st), op, phase);
  double t = ep_ctx_timeout(s->ctx), deadline = ep_now() + t;
  long nap = 0;
  unsigned naps = 0;
  while (!rc) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      rc = cuda_check(s, e, op, phase);
      break;
    }
    if (ep_now() > deadline) {
      rc = ep_ctx_fail(s->ctx, EP_ERR_TIMEOUT, -1, op, phase,
                       "deadline of %.1f s passed waiting for this rank's stream", t);
      break;
    }
    /* The stream may hold transfers from a peer that died: fail with its name, not later. */
    if (nap >= 200 && ++naps % 200 == 0 && ep_ctx_liveness(s->ctx) != EP_OK) { /* ~10 ms */
      rc = ep_ctx_fail(s->ctx, EP_ERR_PEER_FAILED, -1, op, phase, "%s", ep_last_error());
      break;
    }
    if (nap < 200) {
      nap += 5;
      sched_yield();
    } else {
      struct timespec ts = {0, 50000};
      nanosleep(&ts, NULL);
    }
  }
  cudaEventDestroy(ev);
  return rc;
}

ep_status_t cuda_net_allgather(cuda_state_t *s, int tag, const void *mine, void *all, size_t bytes,
                               const char *op, const char *phase) {
  cuda_net_t *n = s->net;
  ep_status_t st = ep_ctx_net_allgather(s->ctx, n->me, n->ctl, tag, mine, all, bytes, op, phase);
  if (st) ep_ctx_mark_broken(s->ctx); /* the ranks are out of step from here */
  return st;
}

ep_status_t cuda_net_fence(cuda_state_t *s, cudaStream_t st, ep_status_t mine, const char *op,
                           const char *phase) {
  /* A timeout or a lost peer already broke the buffer: no second wait for the same peer. */
  if (mine == EP_ERR_TIMEOUT || mine == EP_ERR_PEER_FAILED) return mine;
  if (!mine) mine = cuda_net_sync(s, st, op, phase);
  return cuda_net_agree(s, mine, op, phase);
}

ep_status_t cuda_net_post(cuda_state_t *s, ep_net_xfer_t *x, int count, cudaStream_t st,
                          const char *op, const char *phase) {
  cuda_net_t *n = s->net;
  if (!count) return EP_OK;
  ep_status_t rc = n->e->post(n->ep, x, count, st);
  if (rc) { /* the communicator may hold half a batch: only destroy remains */
    ep_ctx_mark_broken(s->ctx);
    return ep_ctx_fail(s->ctx, rc, -1, op, phase, "%s", ep_ctx_last_error());
  }
  for (int i = 0; i < count; i++) /* NCCL carries rows inside a host too (low-latency mode) */
    if (x[i].send && x[i].peer != s->rank)
      __atomic_fetch_add(n->host_of[x[i].peer] != n->host ? &n->net_bytes : &n->local_bytes,
                         x[i].bytes, __ATOMIC_RELAXED);
  return EP_OK;
}

void cuda_net_count_local(cuda_state_t *s, const cuda_nplan_t *p, uint64_t row) {
  cuda_net_t *n = s->net;
  uint64_t rows = 0;
  for (int b = 0; b < p->H; b++)
    for (int l = 0; l < p->L; l++)
      if (l != n->lrank)
        rows += (uint64_t)p->cnt[(size_t)p->col[b] * p->R + n->rank_at[n->host * p->L + l]];
  __atomic_fetch_add(&n->local_bytes, rows * row, __ATOMIC_RELAXED);
}

void cuda_net_abandon(cuda_state_t *s, ep_net_xfer_t *x, int count) {
  if (count) s->net->e->cancel(s->net->ep, x, count);
  ep_ctx_mark_broken(s->ctx); /* NCCL cannot take them back: only destroy (abort) remains */
}

ep_status_t cuda_net_complete(cuda_state_t *s, ep_net_xfer_t *x, int count, const char *op,
                              const char *phase) {
  ep_status_t st = ep_ctx_net_wait(s->ctx, s->net->e, s->net->ep, x, count, op, phase);
  if (st) ep_ctx_mark_broken(s->ctx); /* NCCL cannot take a posted transfer back */
  return st;
}

ep_status_t cuda_net_agree(cuda_state_t *s, ep_status_t mine, const char *op, const char *phase) {
  int32_t ok = mine == EP_OK, *all = calloc((size_t)s->nranks, sizeof *all);
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  const ep_status_t xs =
      all ? cuda_net_allgather(s, CUDA_NET_TAG_NORMAL, &ok, all, sizeof ok, op, phase)
          : ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, op, phase, "out of memory");
  ep_status_t st = xs;
  for (int r = 0; r < s->nranks && !st && !mine; r++)
    if (!all[r])
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, op, phase,
                       "rank %d could not plan the call (see its error)", r);
  /* After a failed exchange a late message could still land in `all` (a receive the engine
   * could not take back): it is left to the buffer, broken from then on, as world.c does. */
  if (!xs) free(all);
  if (mine) ep_ctx_restore_error(saved);
  return mine ? mine : st;
}

ep_status_t cuda_net_counts(cuda_state_t *s, const int32_t *mine, const char *op) {
  cuda_net_t *n = s->net;
  ep_status_t st = cuda_net_allgather(s, CUDA_NET_TAG_NORMAL, mine, n->counts,
                                      (size_t)n->cw * sizeof *mine, op, "counts");
  if (st) return st;
  /* The key holds the number of the dispatch a combine or cached dispatch follows: handles of
   * different dispatches would move blocks of different sizes, and fail here alike. */
  return ep_call_keys_check(s->ctx, op, (const ep_call_key_t *)mine, n->counts, (size_t)n->cw,
                            s->nranks, s->rank);
}

void cuda_net_reject(cuda_state_t *s, const char *op) {
  int32_t *mine = calloc((size_t)s->net->cw, sizeof *mine);
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ep_ctx_last_error());
  if (mine) {
    ((ep_call_key_t *)mine)->rejected = 1;
    ep_status_t st = cuda_net_counts(s, mine, op);
    if (st && st != EP_ERR_PEER_INVALID && st != EP_ERR_MISMATCH) ep_ctx_mark_broken(s->ctx);
  } else {
    ep_ctx_mark_broken(s->ctx);
  }
  free(mine);
  ep_ctx_restore_error(saved);
}
