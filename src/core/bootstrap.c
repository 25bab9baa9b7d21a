/* See bootstrap.h. Frames are a frame_t header, then `len` payload bytes (FDS frames: `len`
 * descriptors attached to the header as SCM_RIGHTS). Every exchange is a gather at rank 0, which
 * checks that all frames belong to its own call and exchange, then an answer to every peer: the
 * data, or a verdict (a peer rejected the call, ranks are in different calls, a rank gave up). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "boot_io.h"
#include "internal.h"

enum { F_DATA = 1, F_FDS = 2, F_ABORT = 3, F_MISMATCH = 4, F_REJECT = 5 };
#define FDS_PER_FRAME 200 /* well under the kernel's SCM_MAX_FD (253) */
#define SLICE_MS 10       /* liveness is checked this often while waiting */

typedef struct {
  uint16_t type, op; /* op, seq, step: the sender's call (bootstrap.h) */
  uint32_t seq, step;
  int32_t rank;    /* the sender; ABORT: the rank at fault; REJECT: the rank that rejected */
  int32_t aux;     /* ABORT: the rank reporting it; REJECT: its status */
  uint32_t status; /* DATA: the sender's status for the call (0, or why it rejected it) */
  uint64_t len;    /* payload bytes; FDS: descriptors attached */
} frame_t;

/* Two ranks in different exchanges, as rank 0 saw them: [0] rank 0's, [1] that of `rank`. */
typedef struct {
  int32_t rank;
  uint16_t op[2];
  uint32_t seq[2], step[2];
  uint64_t len[2];
} mismatch_t;

/* The peer whose link failed last on this thread: an ABORT names it, so that every rank's error
 * points at the rank at fault rather than at the one that noticed. Per thread, since a group's
 * exchanges run on the calling thread. */
static _Thread_local int failed_peer = -1;

const char *ep_boot_op_name(int op) {
  static const char *const names[EP_OP_COUNT] = {
      [EP_OP_NONE] = "no call",
      [EP_OP_GROUP_CREATE] = "ep_group_create",
      [EP_OP_GROUP_BARRIER] = "ep_group_barrier",
      [EP_OP_GROUP_ALLGATHER] = "ep_group_allgather",
      [EP_OP_GROUP_DESTROY] = "ep_group_destroy",
      [EP_OP_BUFFER_CREATE] = "ep_buffer_create",
      [EP_OP_BUFFER_DESTROY] = "ep_buffer_destroy",
      [EP_OP_MEM_REGISTER] = "ep_register_memory",
      [EP_OP_MEM_DEREGISTER] = "ep_deregister_memory",
  };
  return op >= 0 && op < EP_OP_COUNT ? names[op] : "an unknown call";
}

/* ------------------------------------------------------------------ bounded I/O */

ep_status_t ep_bio_fail(ep_status_t st, int peer, const char *fmt, ...) {
  char msg[EP_ERRMSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  failed_peer = peer;
  ep_err_set_msg(msg);
  return st;
}

int ep_bio_ms_left(double deadline, int cap_ms) {
  double left = deadline - ep_now();
  if (left <= 0) return 0;
  return left * 1000 >= cap_ms ? cap_ms : (int)(left * 1000) + 1;
}

ep_status_t ep_bio_watch(ep_boot_t *b) {
  int r = b->live ? ep_live_check(b->live) : -1;
  if (r < 0) return EP_OK;
  pid_t pid = b->live->pids[r];
  if (r == b->rank || pid <= 0)
    return ep_bio_fail(EP_ERR_PEER_FAILED, r, "bootstrap: rank %d %s", r, b->live->how);
  return ep_bio_fail(EP_ERR_PEER_FAILED, r, "bootstrap: rank %d (pid %d) %s", r, (int)pid,
                     b->live->how);
}

static ep_status_t watch_center(ep_boot_t *b) {
  int r = b->live ? ep_live_check(b->live) : -1;
  return r == 0 || r == b->rank ? ep_bio_watch(b) : EP_OK;
}

ep_status_t ep_bio_wait(ep_boot_t *b, int fd, short events, double deadline, int peer) {
  for (;;) {
    struct pollfd p = {fd, events, 0};
    int n = poll(&p, 1, ep_bio_ms_left(deadline, SLICE_MS));
    if (n > 0) return EP_OK;
    if (n < 0 && errno != EINTR)
      return ep_err(EP_ERR_SYSTEM, "bootstrap: poll: %s", strerror(errno));
    /* A leaf talks only to rank 0, which hears of every death and says so in its answer (or
     * closes: EOF). A leaf must not judge others itself: in the last exchange of a destroy, a
     * released leaf may exit before rank 0 has written this leaf's release. */
    ep_status_t st = b->rank != 0 && peer == 0 ? watch_center(b) : ep_bio_watch(b);
    /* A peer that wrote its verdict and then exited: its bytes are read first (an EOF alone
     * keeps the watch's better message: how the peer died). */
    char c;
    if (st && (events & POLLIN) && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 1) return EP_OK;
    if (st) return st;
    if (ep_now() >= deadline)
      return ep_bio_fail(EP_ERR_TIMEOUT, peer,
                         "bootstrap: deadline passed waiting for rank %d "
                         "(call #%u)",
                         peer, b->seq);
  }
}

ep_status_t ep_bio_write(ep_boot_t *b, int fd, const void *buf, size_t len, double deadline,
                         int peer) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      ep_status_t st = ep_bio_wait(b, fd, POLLOUT, deadline, peer);
      if (st) return st;
    } else {
      return ep_bio_fail(EP_ERR_PEER_FAILED, peer,
                         "bootstrap: rank %d closed its connection "
                         "(%s)",
                         peer, strerror(errno));
    }
  }
  return EP_OK;
}

ep_status_t ep_bio_read(ep_boot_t *b, int fd, void *buf, size_t len, double deadline, int peer) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
    } else if (n == 0) {
      return ep_bio_fail(EP_ERR_PEER_FAILED, peer,
                         "bootstrap: rank %d closed its connection "
                         "(it exited or was killed)",
                         peer);
    } else if (errno == EAGAIN || errno == EINTR) {
      ep_status_t st = ep_bio_wait(b, fd, POLLIN, deadline, peer);
      if (st) return st;
    } else {
      return ep_bio_fail(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d: %s", peer, strerror(errno));
    }
  }
  return EP_OK;
}

/* ------------------------------------------------------------------ frames */

static frame_t frame_of(const ep_boot_t *b, int type, int rank, uint64_t len) {
  return (frame_t){(uint16_t)type, (uint16_t)b->op, b->seq, b->step, rank, 0, 0, len};
}

static ep_status_t send_frame(ep_boot_t *b, int peer, const frame_t *f, const void *data,
                              double deadline) {
  ep_status_t st = ep_bio_write(b, b->socks[peer], f, sizeof *f, deadline, peer);
  return st || f->type == F_FDS ? st
                                : ep_bio_write(b, b->socks[peer], data, f->len, deadline, peer);
}

/* One frame header from `peer` with the descriptors attached to it: up to `room` land in fds
 * (*got of them), any others are closed. */
static ep_status_t read_header(ep_boot_t *b, int peer, frame_t *f, int *fds, int room, int *got,
                               double deadline) {
  union {
    char buf[CMSG_SPACE(FDS_PER_FRAME * sizeof(int))];
    struct cmsghdr align;
  } u;
  struct iovec iov = {f, sizeof *f};
  struct msghdr m = {
      .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  int sock = b->socks[peer];
  ssize_t n;
  *got = 0;
  while ((n = recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC)) <= 0) {
    if (n == 0 || (errno != EAGAIN && errno != EINTR))
      return ep_bio_read(b, sock, f, sizeof *f, deadline, peer); /* says EOF or the error */
    ep_status_t st = ep_bio_wait(b, sock, POLLIN, deadline, peer);
    if (st) return st;
  }
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    int tmp[FDS_PER_FRAME];
    memcpy(tmp, CMSG_DATA(c), (size_t)k * sizeof(int));
    for (int i = 0; i < k; i++) {
      if (*got < room)
        fds[(*got)++] = tmp[i];
      else
        close(tmp[i]);
    }
  }
  if ((size_t)n == sizeof *f) return EP_OK;
  return ep_bio_read(b, sock, (char *)f + n, sizeof *f - (size_t)n, deadline, peer);
}

static void close_fds(int *fds, int n) {
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0) close(fds[i]), fds[i] = -1;
}

static ep_status_t skip_payload(ep_boot_t *b, int peer, uint64_t len, double deadline) {
  char junk[512];
  ep_status_t st = EP_OK;
  for (; len > 0 && !st; len -= len < sizeof junk ? len : sizeof junk)
    st =
        ep_bio_read(b, b->socks[peer], junk, len < sizeof junk ? len : sizeof junk, deadline, peer);
  return st;
}

/* The next frame from `peer` that is not left over from an earlier call of this group (a call
 * that failed before everyone had read everything): those are read and dropped. */
static ep_status_t next_frame(ep_boot_t *b, int peer, frame_t *f, int *fds, int room, int *got,
                              double deadline) {
  for (;;) {
    ep_status_t st = read_header(b, peer, f, fds, room, got, deadline);
    if (st || (int32_t)(f->seq - b->seq) >= 0) return st;
    close_fds(fds, *got);
    if (f->type != F_FDS && (st = skip_payload(b, peer, f->len, deadline))) return st;
  }
}

static bool same_exchange(const ep_boot_t *b, const frame_t *f) {
  return f->op == b->op && f->seq == b->seq && f->step == b->step;
}

/* ------------------------------------------------------------------ verdicts */

static ep_status_t abort_error(const ep_boot_t *b, const frame_t *f) {
  failed_peer = f->rank;
  ep_status_t why = (ep_status_t)f->status;
  ep_status_t st = why == EP_ERR_TIMEOUT ? EP_ERR_TIMEOUT : EP_ERR_PEER_FAILED;
  if (f->rank == b->rank)
    return ep_err(st,
                  "bootstrap: this rank came too late: rank %d gave up waiting for it (call "
                  "#%u, %s)",
                  f->aux, b->seq, ep_status_name(why));
  if (f->rank != f->aux)
    return ep_err(st, "bootstrap: rank %d failed (%s, reported by rank %d)", f->rank,
                  ep_status_name(why), f->aux);
  return ep_err(EP_ERR_PEER_FAILED, "bootstrap: rank %d gave up (%s)", f->rank,
                ep_status_name(why));
}

static ep_status_t reject_error(const ep_boot_t *b, int rank, ep_status_t why) {
  return ep_err(EP_ERR_PEER_INVALID,
                "rank %d rejected its arguments for %s (#%u) (%s; its own "
                "error says which)",
                rank, ep_boot_op_name(b->op), b->seq, ep_status_name(why));
}

static void call_text(char *out, size_t n, int op, uint32_t seq, uint32_t step, bool with_step) {
  if (with_step)
    snprintf(out, n, "%s (#%u, exchange %u)", ep_boot_op_name(op), seq, step);
  else
    snprintf(out, n, "%s (#%u)", ep_boot_op_name(op), seq);
}

/* Every rank words it from where it stands: its own call first, then the other rank's. */
static ep_status_t mismatch_error(const ep_boot_t *b, const mismatch_t *m) {
  int mine = b->rank == m->rank ? 1 : 0, other = 1 - mine, who = mine ? 0 : m->rank;
  uint16_t op[2] = {m->op[0], m->op[1]};
  uint32_t seq[2] = {m->seq[0], m->seq[1]}, step[2] = {m->step[0], m->step[1]};
  if (b->rank != 0 && b->rank != m->rank &&
      (b->op != op[0] || b->seq != seq[0] || b->step != step[0])) {
    /* A bystander that is not in rank 0's exchange either: its quarrel is with rank 0. */
    op[1] = (uint16_t)b->op, seq[1] = b->seq, step[1] = b->step;
    mine = 1, other = 0, who = 0;
  }
  failed_peer = who;
  if (op[0] == op[1] && seq[0] == seq[1] && step[0] == step[1])
    return ep_err(EP_ERR_MISMATCH,
                  "this rank sends %llu bytes in call #%u, rank %d sends %llu "
                  "(ranks disagree about the exchange)",
                  (unsigned long long)m->len[mine], b->seq, who, (unsigned long long)m->len[other]);
  bool steps = op[0] == op[1] && seq[0] == seq[1];
  char a[96], c[96];
  call_text(a, sizeof a, op[mine], seq[mine], step[mine], steps);
  call_text(c, sizeof c, op[other], seq[other], step[other], steps);
  return ep_err(EP_ERR_MISMATCH,
                "this rank calls %s, rank %d calls %s (collective calls must "
                "come in the same order on every rank)",
                a, who, c);
}

/* A verdict frame on the link to rank 0, already read or still waiting there (a rank that comes
 * back late finds rank 0's abort before it notices that rank 0 is gone). */
static ep_status_t verdict_of(ep_boot_t *b, const frame_t *f, ep_status_t mine, double deadline) {
  if (f->type == F_ABORT) return abort_error(b, f);
  if (f->type == F_REJECT) return mine ? mine : reject_error(b, f->rank, (ep_status_t)f->aux);
  mismatch_t m;
  if (f->len != sizeof m) return ep_err(EP_ERR_INTERNAL, "bootstrap: malformed verdict");
  ep_status_t st = ep_bio_read(b, b->socks[0], &m, sizeof m, deadline, 0);
  return st ? st : mismatch_error(b, &m);
}

static ep_status_t pending_verdict(ep_boot_t *b, ep_status_t mine, ep_status_t st) {
  frame_t f;
  int got;
  char saved[EP_ERRMSG_MAX];
  snprintf(saved, sizeof saved, "%s", ep_last_error());
  double now = ep_now();
  if (read_header(b, 0, &f, NULL, 0, &got, now) == EP_OK && (int32_t)(f.seq - b->seq) >= 0 &&
      f.type >= F_ABORT)
    return verdict_of(b, &f, mine, now + 0.1);
  ep_err_set_msg(saved);
  return st;
}

/* ------------------------------------------------------------------ rank 0's side */

typedef struct {
  int rejected; /* the first rank that rejected the call, or -1 */
  ep_status_t why;
  mismatch_t mm; /* mm.rank >= 0: a rank in another exchange */
} verdict_t;

static ep_status_t note_mismatch(ep_boot_t *b, verdict_t *v, int r, const frame_t *f,
                                 uint64_t want) {
  v->mm = (mismatch_t){
      r, {(uint16_t)b->op, f->op}, {b->seq, f->seq}, {b->step, f->step}, {want, f->len}};
  return EP_ERR_MISMATCH;
}

/* Rank r's part of the current exchange: `bytes` into dst, or one descriptor into *fd. */
static ep_status_t root_recv_part(ep_boot_t *b, int r, void *dst, size_t bytes, int *fd,
                                  verdict_t *v, double deadline) {
  frame_t f;
  int fds[FDS_PER_FRAME], got;
  ep_status_t st = next_frame(b, r, &f, fds, FDS_PER_FRAME, &got, deadline);
  if (st) return st;
  uint64_t want = fd ? 1 : bytes;
  bool ok =
      same_exchange(b, &f) && f.type == (fd ? F_FDS : F_DATA) && (f.status != 0 || f.len == want);
  if (f.type == F_ABORT || !ok || f.status != 0 || !fd) close_fds(fds, got);
  if (f.type == F_ABORT) return abort_error(b, &f);
  if (!ok) return note_mismatch(b, v, r, &f, want);
  if (f.status != 0) {
    if (v->rejected < 0) v->rejected = r, v->why = (ep_status_t)f.status;
    return skip_payload(b, r, f.len, deadline);
  }
  if (fd) {
    *fd = got > 0 ? fds[0] : -1;
    close_fds(fds + 1, got - 1);
    return got == 1 ? EP_OK : ep_err(EP_ERR_INTERNAL, "bootstrap: rank %d sent %d fds", r, got);
  }
  return ep_bio_read(b, b->socks[r], dst, bytes, deadline, r);
}

static ep_status_t gather_timeout(ep_boot_t *b, const struct pollfd *p) {
  for (int r = 1; r < b->nranks; r++)
    if (p[r].fd >= 0)
      return ep_bio_fail(EP_ERR_TIMEOUT, r,
                         "bootstrap: deadline passed waiting for rank %d (call "
                         "#%u: it has not entered it)",
                         r, b->seq);
  return EP_OK;
}

/* Rank 0 collects every peer's part, in whatever order they arrive. */
static ep_status_t root_gather(ep_boot_t *b, void *recv, size_t bytes, int *fds, verdict_t *v,
                               double deadline) {
  int n = b->nranks, left = n - 1;
  struct pollfd *p = calloc((size_t)n, sizeof *p);
  if (!p) return ep_err(EP_ERR_NO_MEMORY, "bootstrap: out of memory");
  for (int r = 1; r < n; r++) p[r] = (struct pollfd){b->socks[r], POLLIN, 0};
  p[0].fd = -1;
  ep_status_t st = EP_OK;
  while (left > 0 && !st) {
    int k = poll(p, (nfds_t)n, ep_bio_ms_left(deadline, SLICE_MS));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) st = ep_err(EP_ERR_SYSTEM, "bootstrap: poll: %s", strerror(errno));
    if (k == 0 && !(st = ep_bio_watch(b)) && ep_now() >= deadline) st = gather_timeout(b, p);
    for (int r = 1; k > 0 && r < n && !st; r++) {
      if (p[r].fd < 0 || !p[r].revents) continue;
      st = root_recv_part(b, r, (char *)recv + (size_t)r * bytes, bytes, fds ? &fds[r] : NULL, v,
                          deadline);
      p[r].fd = -1;
      left--;
    }
  }
  free(p);
  return st;
}

/* Tells every peer what went wrong with the exchange (best effort, bounded). */
static void root_broadcast_verdict(ep_boot_t *b, const frame_t *f, const void *payload) {
  double deadline = ep_now() + 1.0;
  for (int r = 1; r < b->nranks; r++) (void)send_frame(b, r, f, payload, deadline);
}

static ep_status_t root_verdict(ep_boot_t *b, const verdict_t *v, ep_status_t mine,
                                ep_status_t st) {
  if (st == EP_ERR_MISMATCH && v->mm.rank >= 0) {
    frame_t f = frame_of(b, F_MISMATCH, 0, sizeof v->mm);
    root_broadcast_verdict(b, &f, &v->mm);
    return mismatch_error(b, &v->mm);
  }
  if (st || (!mine && v->rejected < 0)) return st;
  frame_t f = frame_of(b, F_REJECT, mine ? 0 : v->rejected, 0);
  f.aux = mine ? (int32_t)mine : (int32_t)v->why;
  root_broadcast_verdict(b, &f, NULL);
  return mine ? mine : reject_error(b, v->rejected, v->why);
}

/* ------------------------------------------------------------------ exchanges */

/* Peers wait for rank 0's answer a little longer than rank 0 waits for them, so that when a
 * rank never comes, rank 0's verdict (naming it) reaches them before their own deadline (which
 * could only name rank 0). */
static double answer_deadline(double deadline) {
  double left = deadline - ep_now();
  return deadline + (left > 0 ? left / 4 : 0);
}

static ep_status_t peer_allgather(ep_boot_t *b, const void *send, void *recv, size_t bytes,
                                  ep_status_t mine, double deadline) {
  frame_t f = frame_of(b, F_DATA, b->rank, mine ? 0 : bytes);
  f.status = (uint32_t)mine;
  ep_status_t st = send_frame(b, 0, &f, send, deadline);
  if (st) return pending_verdict(b, mine, st);
  uint64_t total = (uint64_t)bytes * (uint64_t)b->nranks;
  int got;
  st = next_frame(b, 0, &f, NULL, 0, &got, answer_deadline(deadline));
  if (st) return st;
  if (f.type >= F_ABORT) return verdict_of(b, &f, mine, deadline);
  if (!same_exchange(b, &f) || f.type != F_DATA || f.len != total || mine) {
    /* Rank 0 answered another exchange than this rank's. */
    mismatch_t m = {
        b->rank, {f.op, (uint16_t)b->op}, {f.seq, b->seq}, {f.step, b->step}, {f.len, total}};
    return mismatch_error(b, &m);
  }
  return ep_bio_read(b, b->socks[0], recv, total, deadline, 0);
}

static ep_status_t root_allgather(ep_boot_t *b, const void *send, void *recv, size_t bytes,
                                  ep_status_t mine, double deadline) {
  verdict_t v = {-1, EP_OK, {.rank = -1}};
  if (!mine) memcpy(recv, send, bytes);
  ep_status_t st = root_gather(b, recv, bytes, NULL, &v, deadline);
  st = root_verdict(b, &v, mine, st);
  frame_t f = frame_of(b, F_DATA, 0, (uint64_t)bytes * (uint64_t)b->nranks);
  for (int r = 1; r < b->nranks && !st; r++) st = send_frame(b, r, &f, recv, deadline);
  return st;
}

ep_status_t ep_boot_allgather(ep_boot_t *b, const void *send, void *recv, size_t bytes,
                              ep_status_t mine, double deadline) {
  failed_peer = -1;
  b->step++;
  char saved[EP_ERRMSG_MAX];
  if (mine) snprintf(saved, sizeof saved, "%s", ep_last_error());
  ep_status_t st = b->rank == 0 ? root_allgather(b, send, recv, bytes, mine, deadline)
                                : peer_allgather(b, send, recv, bytes, mine, deadline);
  /* A verdict (rejection, mismatch) reached every rank already; a failure must be told. */
  if (st && st != EP_ERR_PEER_INVALID && st != EP_ERR_MISMATCH && st != mine) ep_boot_abort(b, st);
  if (mine) ep_err_set_msg(saved); /* the rejecting rank keeps its own, precise message */
  return mine ? mine : st;
}

ep_status_t ep_boot_barrier(ep_boot_t *b, ep_status_t mine, double deadline) {
  char one = 1, *all = malloc((size_t)b->nranks);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "bootstrap: out of memory");
  ep_status_t st = ep_boot_allgather(b, &one, all, 1, mine, deadline);
  free(all);
  return st;
}

/* ------------------------------------------------------------------ file descriptors */

static ep_status_t send_fds(ep_boot_t *b, int peer, const int *fds, int count, double deadline) {
  for (int off = 0; off < count; off += FDS_PER_FRAME) {
    int k = count - off < FDS_PER_FRAME ? count - off : FDS_PER_FRAME;
    frame_t f = frame_of(b, F_FDS, b->rank, (uint64_t)k);
    union {
      char buf[CMSG_SPACE(FDS_PER_FRAME * sizeof(int))];
      struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u); /* the padding of the control message is sent too */
    struct iovec iov = {&f, sizeof f};
    struct msghdr m = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = u.buf,
                       .msg_controllen = CMSG_SPACE((size_t)k * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN((size_t)k * sizeof(int));
    memcpy(CMSG_DATA(c), fds + off, (size_t)k * sizeof(int));
    for (;;) {
      ssize_t n = sendmsg(b->socks[peer], &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n == (ssize_t)sizeof f) break;
      if (n > 0)
        return ep_bio_write(b, b->socks[peer], (char *)&f + n, sizeof f - (size_t)n, deadline,
                            peer);
      if (errno != EAGAIN && errno != EINTR)
        return ep_bio_fail(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d: %s", peer,
                           strerror(errno));
      ep_status_t st = ep_bio_wait(b, b->socks[peer], POLLOUT, deadline, peer);
      if (st) return st;
    }
  }
  return EP_OK;
}

/* A peer receives every rank's descriptor from rank 0, in frames of FDS_PER_FRAME. */
static ep_status_t peer_recv_fds(ep_boot_t *b, int *out, int count, double deadline) {
  for (int have = 0; have < count;) {
    frame_t f;
    int got;
    ep_status_t st = next_frame(b, 0, &f, out + have, count - have, &got, deadline);
    if (!st && f.type >= F_ABORT)
      st = verdict_of(b, &f, EP_OK, deadline);
    else if (!st && (!same_exchange(b, &f) || f.type != F_FDS || f.len != (uint64_t)got))
      st = ep_err(EP_ERR_MISMATCH, "%s (#%u): rank 0 answered another exchange (%s #%u)",
                  ep_boot_op_name(b->op), b->seq, ep_boot_op_name(f.op), f.seq);
    if (st) return close_fds(out, have + got), st;
    have += got;
  }
  return EP_OK;
}

static ep_status_t root_allgather_fd(ep_boot_t *b, int fd, int *fds, double deadline) {
  verdict_t v = {-1, EP_OK, {.rank = -1}};
  ep_status_t st = root_gather(b, NULL, 0, fds, &v, deadline);
  st = root_verdict(b, &v, EP_OK, st);
  fds[0] = fd; /* sent as is; replaced by a private duplicate below */
  for (int r = 1; r < b->nranks && !st; r++) st = send_fds(b, r, fds, b->nranks, deadline);
  fds[0] = -1;
  if (!st && (fds[0] = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
    st = ep_err(EP_ERR_SYSTEM, "bootstrap: dup: %s", strerror(errno));
  return st;
}

ep_status_t ep_boot_allgather_fd(ep_boot_t *b, int fd, int *fds, double deadline) {
  failed_peer = -1;
  b->step++;
  int n = b->nranks;
  for (int r = 0; r < n; r++) fds[r] = -1;
  ep_status_t st;
  if (b->rank == 0) {
    st = root_allgather_fd(b, fd, fds, deadline);
  } else {
    st = send_fds(b, 0, &fd, 1, deadline);
    if (st)
      st = pending_verdict(b, EP_OK, st);
    else
      st = peer_recv_fds(b, fds, n, answer_deadline(deadline));
  }
  if (st) {
    close_fds(fds, n);
    if (st != EP_ERR_PEER_INVALID && st != EP_ERR_MISMATCH) ep_boot_abort(b, st);
  }
  return st;
}

/* ------------------------------------------------------------------ failure and teardown */

void ep_boot_begin(ep_boot_t *b, int op) {
  b->op = op;
  b->seq = b->next_seq++;
  b->step = 0;
}

int ep_boot_failed_peer(void) {
  return failed_peer;
}

void ep_boot_abort(ep_boot_t *b, ep_status_t why) {
  if (!b->socks) return;
  int culprit = failed_peer >= 0 ? failed_peer : b->rank;
  frame_t f = frame_of(b, F_ABORT, culprit, 0);
  f.aux = b->rank;
  f.status = (uint32_t)why;
  /* Best effort and non-blocking: a full socket means that peer is gone or stuck anyway. */
  for (int r = 0; r < b->nranks; r++)
    if (b->socks[r] >= 0) (void)!send(b->socks[r], &f, sizeof f, MSG_NOSIGNAL | MSG_DONTWAIT);
}

void ep_boot_close(ep_boot_t *b) {
  if (b->socks)
    for (int r = 0; r < b->nranks; r++)
      if (b->socks[r] >= 0) close(b->socks[r]);
  if (b->listen_fd >= 0) close(b->listen_fd);
  free(b->socks);
  b->socks = NULL;
  b->listen_fd = -1;
}
