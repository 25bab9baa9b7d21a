/* Streams, host waits and failures of the CUDA backend.
 *
 * Kernels never trap: a kernel that gives up records why (status, phase, peer) in a device word
 * and in the mapped host block, and returns. A synchronous call reads it right away; a failure
 * in an asynchronous call (worst-case or cached dispatch, combine) is seen by the next call on
 * the buffer: a deadline or a dead peer fails it and breaks the buffer (only destroy/release
 * remain); a failure that moved no data on any rank is logged (warn) and the call goes on. */
#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "cuda/cuda.h"
#include "cuda/cuda_ll.h"
#include "cuda/cuda_net.h"

int cuda_set_device(int dev, int *prev) {
  *prev = -1;
  if (cudaGetDevice(prev) != cudaSuccess) *prev = -1;
  return *prev == dev ? 0 : (int)cudaSetDevice(dev);
}

bool cuda_capturing(cudaStream_t st) {
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) return false;
  return cs != cudaStreamCaptureStatusNone;
}

ep_status_t cuda_check(cuda_state_t *s, cudaError_t e, const char *op, const char *what) {
  if (e == cudaSuccess) return EP_OK;
  return ep_ctx_fail(s->ctx, EP_ERR_CUDA, -1, op, what, "%s (%s)", cudaGetErrorString(e),
                     cudaGetErrorName(e));
}

static const char *phase_name(unsigned p) {
  switch (p) {
    case EPK_PH_NOTIFY:
      return "notify";
    case EPK_PH_ARRIVE:
      return "dispatch data";
    case EPK_PH_WINDOW:
      return "dispatch window";
    case EPK_PH_STAGED:
      return "combine data";
    case EPK_PH_CDONE:
      return "combine release";
    case EPK_PH_LL_ENTER:
      return "enter";
    case EPK_PH_LL_GATE:
      return "gate";
    case EPK_PH_LL_DATA:
    case EPK_PH_LL_COMB:
    case EPK_PH_LL_ZDONE:
      return "recv";
    case EPK_PH_LATE:
      return "late hello";
    default:
      return "check";
  }
}

static const char *waited_for(unsigned p) {
  switch (p) {
    case EPK_PH_NOTIFY:
      return "its hello (counts and call description)";
    case EPK_PH_ARRIVE:
      return "its rows";
    case EPK_PH_WINDOW:
      return "it to free its receive window";
    case EPK_PH_STAGED:
      return "its rows to combine";
    case EPK_PH_LL_ENTER:
      return "its entry into the previous low-latency dispatch";
    case EPK_PH_LL_GATE:
      return "its entry into this low-latency dispatch";
    case EPK_PH_LL_DATA:
      return "its rows of this low-latency dispatch";
    case EPK_PH_LL_COMB:
      return "its rows of this low-latency combine";
    case EPK_PH_LL_ZDONE:
      return "it to finish reading this rank's zero-copy combine input";
    case EPK_PH_LATE:
      return "its late hello (where its allocator put the outputs; a rank whose count exchange "
             "failed never posts it)";
    default:
      return "it to finish reading our rows";
  }
}

/* Takes the host's error word (0 if none) and clears both words. A kernel still running may
 * replace a word that moved no data with one that breaks the buffer (epk_err_claim) and post it
 * at any time: the host word is taken by CAS (a replacement posted meanwhile is the one taken),
 * and the device word cleared only if it still holds what was taken (a replacement stays, and is
 * posted, for the next look). The deferred low-latency verdict is copied before the device word
 * is cleared: after that a kernel may claim it again and write its own. */
static uint64_t take_word(cuda_state_t *s, epk_ll_report_t *deferred) {
  unsigned long long v = __atomic_load_n(&s->host->err, __ATOMIC_ACQUIRE); /* (its type) */
  if (!v) return 0;
  while (!__atomic_compare_exchange_n(&s->host->err, &v, 0ull, false, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE)) {
  }
  memcpy(deferred, (const void *)&s->host->ll_defer, sizeof *deferred);
  if (epk_launch_clear_err(&s->kb, v, s->side) == cudaSuccess) cudaStreamSynchronize(s->side);
  return v;
}

/* The status and message of error word v; d: the deferred low-latency verdict behind it (NULL
 * for a word that is not a deferred one). */
static ep_status_t explain_word(cuda_state_t *s, uint64_t v, const epk_ll_report_t *d,
                                const char *op) {
  unsigned code = (unsigned)(v >> 56), phase = (unsigned)(v >> 48) & 0xff;
  int peer = (int)((v >> 32) & 0xffff) - 1;
  unsigned detail = (unsigned)v;
  const char *ph = phase_name(phase);
  /* A low-latency failure that moved no data, in a call nobody waited for: its kernel left the
   * details in the deferred report (the gate's, the combine check's or the receive's verdict),
   * which names that call, not the one that finds it. */
  if (d && epk_code_no_data(code) &&
      (phase == EPK_PH_LL_GATE || phase == EPK_PH_LL_CHECK || phase == EPK_PH_LL_COMB)) {
    const bool comb = phase != EPK_PH_LL_GATE;
    return cuda_ll_explain(s, d, comb ? "ep_ll_combine" : "ep_ll_dispatch", comb, ph);
  }
  switch (code) {
    case EP_ERR_TIMEOUT:
      return ep_ctx_fail(s->ctx, EP_ERR_TIMEOUT, peer, op, ph,
                         "rank %d did not arrive within %.3g s (waiting for %s)", peer,
                         ep_ctx_timeout(s->ctx), waited_for(phase));
    case EP_ERR_MISMATCH:
    case EP_ERR_PEER_INVALID: /* the kernel names the field of the call key (or "rejected") */
      return ep_call_key_fail(s->ctx, op, ph,
                              code == EP_ERR_PEER_INVALID ? EP_CF_REJECTED : (int)detail,
                              &s->err_key, NULL, peer);
    case EP_ERR_OUT_OF_RANGE: {
      unsigned k = (unsigned)(s->err_key.f[EP_CF_TOPK] > 0 ? s->err_key.f[EP_CF_TOPK] : 1);
      return ep_call_bad_expert(s->ctx, op, detail / k, (int)(detail % k), s->host->bad_value,
                                s->err_key.f[EP_CF_EXPERTS]);
    }
    case EP_ERR_TOO_LARGE:
      return ep_ctx_fail(s->ctx, EP_ERR_TOO_LARGE, peer, op, ph,
                         "%u rows arrive on rank %d, more than its outputs hold "
                         "(worst_case_tokens, or the receive area for views)",
                         detail, peer >= 0 ? peer : s->rank);
    default:
      return ep_ctx_fail(s->ctx, (ep_status_t)code, peer, op, ph, "a kernel failed");
  }
}

ep_status_t cuda_take_error(cuda_state_t *s, const char *op) {
  epk_ll_report_t d;
  const uint64_t v = take_word(s, &d);
  return v ? explain_word(s, v, &d, op) : EP_OK;
}

ep_status_t cuda_explain_word(cuda_state_t *s, uint64_t v, const char *op) {
  return explain_word(s, v, NULL, op);
}

/* A failure recorded by a kernel of an earlier asynchronous call. Failures every rank saw alike
 * and that moved no data (a rank rejected its arguments, the ranks disagree, the outputs were too
 * small) leave the buffer consistent: they are logged, and this call goes on (failing it would
 * leave the peers waiting). The others (a deadline, a dead peer) break the buffer. */
ep_status_t cuda_deferred(cuda_state_t *s, const char *op) {
  ep_status_t st = cuda_take_error(s, op);
  if (!st) return EP_OK;
  if (epk_code_no_data((uint32_t)st)) {
    ep_log_at(EP_LOG_WARN, s->rank, "run",
              "an earlier asynchronous call failed and moved no "
              "data: %s",
              ep_last_error());
    return EP_OK;
  }
  ep_ctx_mark_broken(s->ctx);
  return st;
}

ep_status_t cuda_enter(cuda_state_t *s, void *stream, const char *op, cudaStream_t *out) {
  *out = (cudaStream_t)stream;
  if (cuda_set_device(s->device, &s->prev_device))
    return cuda_check(s, cudaGetLastError(), op, "device");
  ep_status_t st = cuda_deferred(s, op);
  if (st) {
    cuda_leave(s, *out, false);
    return st;
  }
  /* Calls on different streams still run in call order (peers count on it). */
  if (s->last_valid && s->last_stream != *out && !cuda_capturing(*out) &&
      (st = cuda_check(s, cudaStreamWaitEvent(*out, s->last, 0), op, "stream order")))
    cuda_leave(s, *out, false);
  return st;
}

void cuda_leave(cuda_state_t *s, cudaStream_t st, bool record) {
  /* A captured call is ordered by the graph: nothing to record. */
  if (record && !cuda_capturing(st) && cudaEventRecord(s->last, st) == cudaSuccess) {
    s->last_stream = st;
    s->last_valid = true;
  }
  if (s->prev_device >= 0 && s->prev_device != s->device) cudaSetDevice(s->prev_device);
}

/* Whether the error word ends a wait: only a failure that breaks the buffer (a deadline, a dead
 * peer: the kernel may never set the word then), whoever recorded it. One that moved no data may
 * come from an earlier asynchronous call meanwhile, without harm: the word still comes. */
static bool ends_wait(const cuda_state_t *s) {
  const uint64_t v = __atomic_load_n(&s->host->err, __ATOMIC_ACQUIRE);
  return v && !epk_code_no_data((uint32_t)(v >> 56));
}

ep_status_t cuda_wait_word(cuda_state_t *s, const uint32_t *word, uint32_t want, const char *op,
                           const char *phase) {
  double start = ep_now(), deadline = start + ep_ctx_timeout(s->ctx) + 10.0, next = start + 0.05;
  for (unsigned spins = 0;; spins++) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == want) return EP_OK;
    if (ends_wait(s)) return EP_OK; /* the caller reports it */
    if (spins % 256) continue;
    double now = ep_now();
    if (now < next) {
      sched_yield();
      continue;
    }
    next = now + 0.05;
    int dead = -1;
    const char *how = NULL;
    if (ep_ctx_check_peers(s->ctx, &dead, &how) == EP_ERR_PEER_FAILED) {
      __atomic_store_n(&s->host->abort, 1u, __ATOMIC_RELEASE);
      return ep_ctx_fail(s->ctx, EP_ERR_PEER_FAILED, dead, op, phase, "rank %d died (%s)", dead,
                         how ? how : "no longer alive");
    }
    if (now > deadline) {
      __atomic_store_n(&s->host->abort, 1u, __ATOMIC_RELEASE);
      return ep_ctx_fail(s->ctx, EP_ERR_TIMEOUT, -1, op, phase,
                         "the kernel did not report within %.3g s (it never ran?)", now - start);
    }
  }
}

ep_status_t cuda_wait_settled(cuda_state_t *s, const uint32_t *word, uint32_t want, const char *op,
                              const char *phase,
                              ep_status_t (*earlier)(cuda_state_t *, const char *)) {
  for (;;) {
    ep_status_t st = cuda_wait_word(s, word, want, op, phase);
    if (st || __atomic_load_n(word, __ATOMIC_ACQUIRE) == want || ends_wait(s)) return st;
    if (__atomic_load_n(&s->host->err, __ATOMIC_ACQUIRE) && (st = earlier(s, op))) return st;
  }
}

ep_status_t cuda_wait_ticket(cuda_state_t *s, uint32_t ticket, const char *op,
                             ep_status_t (*earlier)(cuda_state_t *, const char *)) {
  return cuda_wait_settled(s, &s->host->ticket, ticket, op, "notify", earlier);
}

bool cuda_quiesce(cuda_state_t *s, double seconds) {
  double deadline = ep_now() + seconds;
  bool aborted = false;
  for (;;) {
    cudaError_t a = s->last_valid ? cudaEventQuery(s->last) : cudaSuccess;
    cudaError_t b = s->side ? cudaStreamQuery(s->side) : cudaSuccess;
    if (a != cudaErrorNotReady && b != cudaErrorNotReady) return !aborted;
    if (ep_now() > deadline) {
      if (aborted) return false;
      /* Kernels still wait for peers that will not come: tell them to stop, give them 1 s. */
      __atomic_store_n(&s->host->abort, 1u, __ATOMIC_RELEASE);
      aborted = true;
      deadline = ep_now() + 1.0;
    }
    sched_yield();
  }
}

void cuda_reject(void *state) {
  cuda_state_t *s = state;
  int prev;
  if (cuda_set_device(s->device, &prev)) return;
  if (s->net) {
    cuda_net_reject(s, "rejected call");
    if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
    return;
  }
  if (s->last_valid) cudaStreamWaitEvent(s->side, s->last, 0);
  epk_notify_t k;
  memset(&k, 0, sizeof k);
  k.kind = EPK_NOTIFY_REJECT;
  if (epk_launch_notify(&s->kb, &k, s->side) == cudaSuccess &&
      cudaEventRecord(s->last, s->side) == cudaSuccess) {
    s->last_stream = s->side;
    s->last_valid = true;
  }
  if (prev >= 0 && prev != s->device) cudaSetDevice(prev);
}
