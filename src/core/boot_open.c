/* Opening a group's bootstrap channel: rank 0 listens on the abstract socket, the others connect,
 * and nobody is let in without proof (bootstrap.h). Rank 0 keeps every connection that has not
 * yet proven itself in a short list and polls them all, so a silent or slow stranger costs it
 * nothing: the stranger is dropped after HELLO_TIMEOUT_S or when the group is complete, and it
 * never receives a byte. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "boot_io.h"
#include "internal.h"

#define HELLO_TIMEOUT_S 5.0 /* a real rank sends its hello right after connect() */
#define MAX_PENDING 64      /* connections not yet proven; more evict the oldest */
#define SLICE_MS 10
#define HELLO_MAGIC 0x31485045u /* "EPH1" */
#define ACK_MAGIC 0x31415045u   /* "EPA1" */

typedef struct {
  uint32_t magic, version;
  int32_t rank, nranks;
  uint8_t mac[32]; /* HMAC(job key, label, rendezvous name, rank, nranks) */
} hello_t;
_Static_assert(sizeof(hello_t) == EP_BOOT_HELLO_BYTES, "hello size");

static void make_hello(hello_t *h, uint32_t magic, const uint8_t key[EP_KEY_BYTES],
                       const char *name, int rank, int nranks) {
  char msg[EP_RENDEZVOUS_MAX + 32];
  size_t n = (size_t)snprintf(msg, sizeof msg, "%s%c%s%c", magic == HELLO_MAGIC ? "hello" : "ack",
                              0, name, 0);
  int32_t nums[2] = {rank, nranks};
  memcpy(msg + n, nums, sizeof nums);
  *h = (hello_t){magic, 1, rank, nranks, {0}};
  ep_hmac_sha256(key, msg, n + sizeof nums, h->mac);
}

size_t ep_boot_hello(void *out, const uint8_t key[EP_KEY_BYTES], const char *name, int rank,
                     int nranks) {
  hello_t h;
  make_hello(&h, HELLO_MAGIC, key, name, rank, nranks);
  memcpy(out, &h, sizeof h);
  return sizeof h;
}

/* The announced rank and size are covered by the MAC: a valid hello is one of this job's ranks. */
static bool hello_valid(const ep_boot_t *b, const hello_t *h, uint32_t magic) {
  hello_t want;
  make_hello(&want, magic, b->key, b->name, h->rank, h->nranks);
  return h->magic == magic && h->version == 1 && ep_ct_equal(h->mac, want.mac, sizeof want.mac);
}

static socklen_t make_addr(struct sockaddr_un *a, const char *name) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  /* Abstract namespace: sun_path[0] == 0, nothing on any filesystem. */
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "epcomm-%s", name);
  if (n < 0 || (size_t)n >= sizeof a->sun_path - 1) n = (int)sizeof a->sun_path - 2;
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static bool peer_cred(int fd, struct ucred *c) {
  socklen_t len = sizeof *c;
  return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, c, &len) == 0;
}

/* ------------------------------------------------------------------ rank 0 */

typedef struct {
  int fd;
  pid_t pid;
  double until; /* dropped then if its hello is not complete */
  size_t got;
  hello_t h;
} pending_t;

typedef struct {
  pending_t p[MAX_PENDING];
  int n;
} pending_list_t;

static void drop(const ep_boot_t *b, pending_t *p, const char *why) {
  if (ep_log_enabled(EP_LOG_DEBUG))
    ep_log_at(EP_LOG_DEBUG, b->rank, "init",
              "bootstrap: dropped a connection to '%s' from pid "
              "%d: %s",
              b->name, (int)p->pid, why);
  close(p->fd);
  p->fd = -1;
}

static void accept_new(ep_boot_t *b, pending_list_t *l) {
  int fd;
  while ((fd = accept4(b->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0) {
    pending_t p = {fd, 0, ep_now() + HELLO_TIMEOUT_S, 0, {0}};
    struct ucred c;
    if (!peer_cred(fd, &c)) {
      drop(b, &p, "no peer credentials");
      continue;
    }
    p.pid = c.pid;
    if (c.uid != geteuid()) { /* other users never get in, whatever they know */
      char why[64];
      snprintf(why, sizeof why, "uid %d, not this job's %d", (int)c.uid, (int)geteuid());
      drop(b, &p, why);
      continue;
    }
    if (l->n == MAX_PENDING) {
      drop(b, &l->p[0], "too many connections waiting to prove themselves");
      memmove(l->p, l->p + 1, (size_t)--l->n * sizeof *l->p);
    }
    l->p[l->n++] = p;
  }
}

/* 1: a complete, valid hello; 0: not yet; -1: dropped. */
static int pending_read(const ep_boot_t *b, pending_t *p) {
  ssize_t n = recv(p->fd, (char *)&p->h + p->got, sizeof p->h - p->got, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  if (n <= 0) return drop(b, p, n == 0 ? "closed before its hello" : strerror(errno)), -1;
  p->got += (size_t)n;
  if (p->got < sizeof p->h) return 0;
  if (!hello_valid(b, &p->h, HELLO_MAGIC))
    return drop(b, p, "not a hello of this job (another secret, or not epcomm)"), -1;
  return 1;
}

/* A proven rank of this job: it must fit this group, else the ranks disagree (fatal). */
static ep_status_t admit(ep_boot_t *b, pending_t *p, int *got) {
  int r = p->h.rank;
  if (p->h.nranks != b->nranks || r <= 0 || r >= b->nranks)
    return ep_err(EP_ERR_MISMATCH,
                  "bootstrap: a rank of this job (pid %d) announced rank %d of "
                  "%d; this group has %d ranks (rank and size must agree on every rank)",
                  (int)p->pid, r, p->h.nranks, b->nranks);
  if (b->socks[r] >= 0)
    return ep_err(EP_ERR_MISMATCH, "bootstrap: two processes claim rank %d (pids %d and %d)", r,
                  b->live ? (int)b->live->pids[r] : 0, (int)p->pid);
  hello_t ack;
  make_hello(&ack, ACK_MAGIC, b->key, b->name, r, b->nranks);
  if (send(p->fd, &ack, sizeof ack, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof ack)
    return drop(b, p, "gone before its answer"), EP_OK;
  b->socks[r] = p->fd;
  p->fd = -1;
  if (b->live) ep_live_set_pid(b->live, r, p->pid, true);
  (*got)++;
  return EP_OK;
}

static ep_status_t never_connected(const ep_boot_t *b, int got) {
  for (int r = 1; r < b->nranks; r++)
    if (b->socks[r] < 0)
      return ep_bio_fail(EP_ERR_TIMEOUT, r,
                         "bootstrap: rank %d never connected (%d of %d "
                         "arrived)",
                         r, got, b->nranks);
  return EP_OK;
}

/* Reads what the waiting connections sent, admits the proven, drops the rest when due. */
static ep_status_t serve_pending(ep_boot_t *b, pending_list_t *l, const struct pollfd *pf,
                                 int *got) {
  ep_status_t st = EP_OK;
  double now = ep_now();
  int k = 0;
  for (int i = 0; i < l->n; i++) {
    pending_t *p = &l->p[i];
    int r = pf && pf[i].revents ? pending_read(b, p) : 0;
    if (r == 1 && !st) st = admit(b, p, got);
    if (p->fd >= 0 && (r == 1 || now >= p->until))
      drop(b, p, r == 1 ? "the group failed" : "no hello within the read timeout");
    if (p->fd >= 0) l->p[k++] = *p;
  }
  l->n = k;
  return st;
}

static ep_status_t root_accept(ep_boot_t *b, double deadline) {
  pending_list_t l = {.n = 0};
  struct pollfd pf[MAX_PENDING + 1];
  ep_status_t st = EP_OK;
  for (int got = 1; got < b->nranks && !st;) {
    pf[0] = (struct pollfd){b->listen_fd, POLLIN, 0};
    for (int i = 0; i < l.n; i++) pf[i + 1] = (struct pollfd){l.p[i].fd, POLLIN, 0};
    int n = l.n, k = poll(pf, (nfds_t)n + 1, ep_bio_ms_left(deadline, SLICE_MS));
    if (k < 0 && errno != EINTR) st = ep_err(EP_ERR_SYSTEM, "bootstrap: poll: %s", strerror(errno));
    if (!st) st = serve_pending(b, &l, k > 0 ? pf + 1 : NULL, &got);
    if (!st && k > 0 && pf[0].revents) accept_new(b, &l);
    if (!st) st = ep_bio_watch(b);
    if (!st && got < b->nranks && ep_now() >= deadline) st = never_connected(b, got);
  }
  for (int i = 0; i < l.n; i++) drop(b, &l.p[i], st ? "the group failed" : "the group is complete");
  return st;
}

static ep_status_t root_listen(ep_boot_t *b) {
  struct sockaddr_un a;
  socklen_t alen = make_addr(&a, b->name);
  b->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (b->listen_fd < 0) return ep_err(EP_ERR_SYSTEM, "bootstrap: socket: %s", strerror(errno));
  if (bind(b->listen_fd, (struct sockaddr *)&a, alen) != 0)
    return ep_err(EP_ERR_BOOTSTRAP,
                  "bootstrap: rendezvous '%s' is taken (%s): another job uses "
                  "the same job id",
                  b->name, strerror(errno));
  if (listen(b->listen_fd, b->nranks + MAX_PENDING) != 0)
    return ep_err(EP_ERR_SYSTEM, "bootstrap: listen: %s", strerror(errno));
  return EP_OK;
}

/* ------------------------------------------------------------------ the other ranks */

/* Rank 0 closed the connection instead of answering. A failure of its own (a rank died) shows in
 * this rank's liveness within moments; otherwise it refused the hello. */
static ep_status_t refused(ep_boot_t *b, pid_t pid) {
  for (int i = 0; i < 20; i++) {
    ep_status_t st = ep_bio_watch(b);
    if (st) return st;
    nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
  }
  return ep_err(EP_ERR_BOOTSTRAP,
                "bootstrap: rank 0 of rendezvous '%s' (pid %d) refused this "
                "rank: another job uses the same rendezvous, or the ranks do not share "
                "EP_JOB_SECRET",
                b->name, (int)pid);
}

/* Connected: make sure the listener is ours before sending anything, then prove each other. */
static ep_status_t handshake(ep_boot_t *b, int fd, double deadline) {
  b->socks[0] = fd;
  struct ucred c;
  if (!peer_cred(fd, &c))
    return ep_err(EP_ERR_SYSTEM, "bootstrap: SO_PEERCRED: %s", strerror(errno));
  if (c.uid != geteuid())
    return ep_err(EP_ERR_BOOTSTRAP,
                  "bootstrap: rendezvous '%s' is held by pid %d of uid %d, "
                  "not by this user: nothing was sent to it",
                  b->name, (int)c.pid, (int)c.uid);
  hello_t h;
  make_hello(&h, HELLO_MAGIC, b->key, b->name, b->rank, b->nranks);
  ep_status_t st = ep_bio_write(b, fd, &h, sizeof h, deadline, 0);
  if (!st) st = ep_bio_read(b, fd, &h, sizeof h, deadline, 0);
  if (st == EP_ERR_PEER_FAILED) return refused(b, c.pid);
  if (st) return st;
  if (!hello_valid(b, &h, ACK_MAGIC) || h.rank != b->rank)
    return ep_err(EP_ERR_BOOTSTRAP,
                  "bootstrap: rendezvous '%s' is held by pid %d, which does "
                  "not know this job's secret",
                  b->name, (int)c.pid);
  if (b->live) ep_live_set_pid(b->live, 0, c.pid, true);
  return EP_OK;
}

static ep_status_t peer_connect(ep_boot_t *b, double deadline) {
  struct sockaddr_un a;
  socklen_t alen = make_addr(&a, b->name);
  for (;;) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return ep_err(EP_ERR_SYSTEM, "bootstrap: socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&a, alen) == 0) return handshake(b, fd, deadline);
    close(fd); /* not listening yet, or its backlog is full: try again */
    ep_status_t st = ep_bio_watch(b);
    if (st) return st;
    if (ep_now() >= deadline)
      return ep_bio_fail(EP_ERR_TIMEOUT, 0, "bootstrap: rank 0 never opened rendezvous '%s'",
                         b->name);
    nanosleep(&(struct timespec){0, 2000000}, NULL);
  }
}

ep_status_t ep_boot_open(ep_boot_t *b, const char *name, const uint8_t key[EP_KEY_BYTES], int rank,
                         int nranks, ep_live_t *live, double deadline) {
  *b = (ep_boot_t){
      .rank = rank, .nranks = nranks, .listen_fd = -1, .live = live, .op = EP_OP_GROUP_CREATE};
  memcpy(b->key, key, EP_KEY_BYTES);
  snprintf(b->name, sizeof b->name, "%s", name);
  b->socks = malloc((size_t)nranks * sizeof(int));
  if (!b->socks) return ep_err(EP_ERR_NO_MEMORY, "bootstrap: out of memory");
  for (int r = 0; r < nranks; r++) b->socks[r] = -1;
  ep_status_t st;
  if (rank == 0) {
    st = root_listen(b);
    if (!st) st = root_accept(b, deadline);
    /* Everyone has connected: the name is no longer needed, free it for reuse at once. */
    if (b->listen_fd >= 0) close(b->listen_fd);
    b->listen_fd = -1;
  } else {
    st = peer_connect(b, deadline);
  }
  if (st) ep_boot_abort(b, st);
  return st;
}
