/* See bootstrap.h. Frames are {type, status, rank, len} followed by len payload bytes; file
 * descriptors travel as SCM_RIGHTS attached to a frame header. */
#include "bootstrap.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

enum { F_HELLO = 1, F_DATA = 2, F_FDS = 3, F_ABORT = 4 };
#define FDS_PER_FRAME 200 /* well under the kernel's SCM_MAX_FD (253) */

typedef struct {
  uint32_t type, status;
  int32_t rank, nranks; /* ABORT: rank = the rank at fault, nranks = the rank reporting it */
  uint64_t len;
} frame_t;

/* The peer whose link failed last on this thread: an ABORT names it, so that every rank's error
 * points at the rank at fault rather than at the one that noticed. Per thread, since a group's
 * exchanges run on the calling thread. */
static _Thread_local int failed_peer = -1;

static ep_status_t peer_error(ep_status_t st, int peer, const char *fmt, int a, const char *b) {
  failed_peer = peer;
  return ep_err(st, fmt, a, b);
}

static int remaining_ms(double deadline) {
  double left = deadline - ep_now();
  if (left <= 0) return 0;
  return left > 1e6 ? 1000000000 : (int)(left * 1000) + 1;
}

static ep_status_t wait_fd(int fd, short events, double deadline, int peer) {
  struct pollfd p = {fd, events, 0};
  for (;;) {
    int n = poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return EP_OK;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ep_err(EP_ERR_SYSTEM, "bootstrap: poll: %s", strerror(errno));
    return peer_error(EP_ERR_TIMEOUT, peer, "bootstrap: deadline passed waiting for rank %d%s",
                      peer, "");
  }
}

static ep_status_t write_all(int fd, const void *buf, size_t len, double deadline, int peer) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      ep_status_t st = wait_fd(fd, POLLOUT, deadline, peer);
      if (st) return st;
    } else {
      return peer_error(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d closed its connection (%s)",
                        peer, strerror(errno));
    }
  }
  return EP_OK;
}

static ep_status_t read_all(int fd, void *buf, size_t len, double deadline, int peer) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
    } else if (n == 0) {
      return peer_error(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d closed its connection%s",
                        peer, " (it exited or was killed)");
    } else if (errno == EAGAIN || errno == EINTR) {
      ep_status_t st = wait_fd(fd, POLLIN, deadline, peer);
      if (st) return st;
    } else {
      return peer_error(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d: %s", peer,
                        strerror(errno));
    }
  }
  return EP_OK;
}

static ep_status_t send_frame(int fd, uint32_t type, int rank, const void *data, size_t len,
                              double deadline, int peer) {
  frame_t f = {type, 0, rank, 0, len};
  ep_status_t st = write_all(fd, &f, sizeof f, deadline, peer);
  return st ? st : write_all(fd, data, len, deadline, peer);
}

/* An ABORT frame turns into the error it carries. */
static ep_status_t check_frame(const frame_t *f, uint32_t want, size_t len, int peer) {
  if (f->type == F_ABORT) {
    failed_peer = f->rank;
    if (f->rank != f->nranks)
      return ep_err((ep_status_t)f->status == EP_ERR_TIMEOUT ? EP_ERR_TIMEOUT : EP_ERR_PEER_FAILED,
                    "bootstrap: rank %d failed (%s, reported by rank %d)", f->rank,
                    ep_status_name((ep_status_t)f->status), f->nranks);
    return ep_err(EP_ERR_PEER_FAILED, "bootstrap: rank %d gave up (%s)", f->rank,
                  ep_status_name((ep_status_t)f->status));
  }
  if (f->type != want || f->len != len)
    return ep_err(EP_ERR_MISMATCH, "bootstrap: rank %d sent %llu bytes where %zu were expected "
                  "(ranks disagree about the exchange)", peer, (unsigned long long)f->len, len);
  return EP_OK;
}

static ep_status_t recv_frame(int fd, uint32_t want, void *data, size_t len, double deadline,
                              int peer) {
  frame_t f;
  ep_status_t st = read_all(fd, &f, sizeof f, deadline, peer);
  if (!st) st = check_frame(&f, want, len, peer);
  return st ? st : read_all(fd, data, len, deadline, peer);
}


/* ------------------------------------------------------------------ file descriptors */

static ep_status_t send_fds(int sock, const int *fds, int count, double deadline, int peer) {
  for (int off = 0; off < count; off += FDS_PER_FRAME) {
    int k = count - off < FDS_PER_FRAME ? count - off : FDS_PER_FRAME;
    frame_t f = {F_FDS, 0, -1, 0, (uint64_t)k};
    union {
      char buf[CMSG_SPACE(FDS_PER_FRAME * sizeof(int))];
      struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u); /* the padding of the control message is sent too */
    struct iovec iov = {&f, sizeof f};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = CMSG_SPACE((size_t)k * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN((size_t)k * sizeof(int));
    memcpy(CMSG_DATA(c), fds + off, (size_t)k * sizeof(int));
    for (;;) {
      ssize_t n = sendmsg(sock, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n == (ssize_t)sizeof f) break;
      if (n > 0) return write_all(sock, (char *)&f + n, sizeof f - (size_t)n, deadline, peer);
      if (errno != EAGAIN && errno != EINTR)
        return peer_error(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d: %s", peer,
                          strerror(errno));
      ep_status_t st = wait_fd(sock, POLLOUT, deadline, peer);
      if (st) return st;
    }
  }
  return EP_OK;
}

/* Receives one frame's header with its descriptors attached. */
static ep_status_t recv_fd_frame(int sock, frame_t *f, int *out, int room, int *got,
                                 double deadline, int peer) {
  union {
    char buf[CMSG_SPACE(FDS_PER_FRAME * sizeof(int))];
    struct cmsghdr align;
  } u;
  struct iovec iov = {f, sizeof *f};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                     .msg_controllen = sizeof u.buf};
  ssize_t n;
  for (;;) {
    n = recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n > 0) break;
    if (n == 0)
      return peer_error(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d closed its connection%s",
                        peer, " (it exited or was killed)");
    if (errno != EAGAIN && errno != EINTR)
      return peer_error(EP_ERR_PEER_FAILED, peer, "bootstrap: rank %d: %s", peer,
                        strerror(errno));
    ep_status_t st = wait_fd(sock, POLLIN, deadline, peer);
    if (st) return st;
  }
  *got = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    int tmp[FDS_PER_FRAME];
    memcpy(tmp, CMSG_DATA(c), (size_t)k * sizeof(int));
    for (int i = 0; i < k; i++) {
      if (*got < room) out[(*got)++] = tmp[i];
      else close(tmp[i]);
    }
  }
  if ((size_t)n < sizeof *f) return read_all(sock, (char *)f + n, sizeof *f - (size_t)n, deadline, peer);
  return EP_OK;
}

static ep_status_t recv_fds(int sock, int *out, int count, double deadline, int peer) {
  int have = 0;
  while (have < count) {
    frame_t f;
    int got = 0;
    ep_status_t st = recv_fd_frame(sock, &f, out + have, count - have, &got, deadline, peer);
    if (!st) st = check_frame(&f, F_FDS, (uint64_t)got, peer);
    if (st) {
      for (int i = 0; i < have + got; i++) close(out[i]);
      for (int i = 0; i < count; i++) out[i] = -1;
      return st;
    }
    have += got;
  }
  return EP_OK;
}

/* ------------------------------------------------------------------ connect */

static socklen_t make_addr(struct sockaddr_un *a, const char *name) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  /* Abstract namespace: sun_path[0] == 0, nothing on any filesystem. */
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "epcomm-%s", name);
  if (n < 0 || (size_t)n >= sizeof a->sun_path - 1) n = (int)sizeof a->sun_path - 2;
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static ep_status_t root_accept(ep_boot_t *b, double deadline) {
  for (int got = 1; got < b->nranks;) {
    ep_status_t st = wait_fd(b->listen_fd, POLLIN, deadline, -1);
    if (st) {
      for (int r = 1; r < b->nranks; r++)
        if (b->socks[r] < 0)
          return ep_err(EP_ERR_TIMEOUT, "bootstrap: rank %d never connected (%d of %d arrived)",
                        r, got, b->nranks);
      return st;
    }
    int fd = accept4(b->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    frame_t f;
    st = read_all(fd, &f, sizeof f, deadline, -1);
    if (st || f.type != F_HELLO || f.rank <= 0 || f.rank >= b->nranks || b->socks[f.rank] >= 0 ||
        f.nranks != b->nranks) {
      close(fd);
      if (st) continue; /* a stray connection; keep waiting for the real ranks */
      return ep_err(EP_ERR_MISMATCH, "bootstrap: a peer announced rank %d of %d; this group has "
                    "%d ranks (rank and size must agree on every rank)", f.rank, f.nranks,
                    b->nranks);
    }
    b->socks[f.rank] = fd;
    got++;
  }
  return EP_OK;
}

static ep_status_t peer_connect(ep_boot_t *b, const char *name, double deadline) {
  struct sockaddr_un a;
  socklen_t alen = make_addr(&a, name);
  for (;;) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ep_err(EP_ERR_SYSTEM, "bootstrap: socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&a, alen) == 0) {
      fcntl(fd, F_SETFL, O_NONBLOCK);
      b->socks[0] = fd;
      frame_t f = {F_HELLO, 0, b->rank, b->nranks, 0};
      return write_all(fd, &f, sizeof f, deadline, 0);
    }
    close(fd);
    if (ep_now() >= deadline)
      return ep_err(EP_ERR_TIMEOUT, "bootstrap: rank 0 never opened rendezvous '%s'", name);
    nanosleep(&(struct timespec){0, 2000000}, NULL); /* rank 0 is not listening yet */
  }
}

static ep_status_t root_listen(ep_boot_t *b, const char *name) {
  struct sockaddr_un a;
  socklen_t alen = make_addr(&a, name);
  b->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (b->listen_fd < 0) return ep_err(EP_ERR_SYSTEM, "bootstrap: socket: %s", strerror(errno));
  if (bind(b->listen_fd, (struct sockaddr *)&a, alen) != 0)
    return ep_err(EP_ERR_BOOTSTRAP, "bootstrap: rendezvous '%s' is taken (%s): another job uses "
                  "the same job id", name, strerror(errno));
  if (listen(b->listen_fd, b->nranks) != 0)
    return ep_err(EP_ERR_SYSTEM, "bootstrap: listen: %s", strerror(errno));
  return EP_OK;
}

ep_status_t ep_boot_open(ep_boot_t *b, const char *name, int rank, int nranks, double deadline) {
  failed_peer = -1;
  b->rank = rank;
  b->nranks = nranks;
  b->listen_fd = -1;
  b->socks = malloc((size_t)nranks * sizeof(int));
  if (!b->socks) return ep_err(EP_ERR_NO_MEMORY, "bootstrap: out of memory");
  for (int r = 0; r < nranks; r++) b->socks[r] = -1;
  ep_status_t st;
  if (rank == 0) {
    st = root_listen(b, name);
    if (!st) st = root_accept(b, deadline);
    /* Everyone has connected: the name is no longer needed, free it for reuse at once. */
    if (b->listen_fd >= 0) close(b->listen_fd);
    b->listen_fd = -1;
  } else {
    st = peer_connect(b, name, deadline);
  }
  if (st) ep_boot_abort(b, st);
  return st;
}

/* ------------------------------------------------------------------ exchanges */

/* Rank 0 collects one frame from every peer, in whatever order they arrive. */
static ep_status_t root_gather(ep_boot_t *b, void *recv, size_t bytes, int *fds,
                               double deadline) {
  int n = b->nranks;
  struct pollfd *p = calloc((size_t)n, sizeof *p);
  if (!p) return ep_err(EP_ERR_NO_MEMORY, "bootstrap: out of memory");
  int left = n - 1;
  for (int r = 1; r < n; r++) p[r] = (struct pollfd){b->socks[r], POLLIN, 0};
  p[0].fd = -1;
  ep_status_t st = EP_OK;
  while (left > 0 && !st) {
    int k = poll(p, (nfds_t)n, remaining_ms(deadline));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      for (int r = 1; r < n; r++)
        if (p[r].fd >= 0) {
          st = peer_error(EP_ERR_TIMEOUT, r, "bootstrap: deadline passed waiting for rank %d%s",
                          r, "");
          break;
        }
      break;
    }
    for (int r = 1; r < n && !st; r++) {
      if (p[r].fd < 0 || !p[r].revents) continue;
      if (fds) {
        st = recv_fds(b->socks[r], &fds[r], 1, deadline, r);
      } else {
        st = recv_frame(b->socks[r], F_DATA, (char *)recv + (size_t)r * bytes, bytes, deadline,
                        r);
      }
      p[r].fd = -1;
      left--;
    }
  }
  free(p);
  return st;
}

ep_status_t ep_boot_allgather(ep_boot_t *b, const void *send, void *recv, size_t bytes,
                              double deadline) {
  failed_peer = -1;
  int n = b->nranks;
  ep_status_t st = EP_OK;
  if (b->rank == 0) {
    memcpy(recv, send, bytes);
    st = root_gather(b, recv, bytes, NULL, deadline);
    for (int r = 1; r < n && !st; r++)
      st = send_frame(b->socks[r], F_DATA, 0, recv, bytes * (size_t)n, deadline, r);
  } else {
    st = send_frame(b->socks[0], F_DATA, b->rank, send, bytes, deadline, 0);
    if (!st) st = recv_frame(b->socks[0], F_DATA, recv, bytes * (size_t)n, deadline, 0);
  }
  if (st) ep_boot_abort(b, st);
  return st;
}

ep_status_t ep_boot_allgather_fd(ep_boot_t *b, int fd, int *fds, double deadline) {
  failed_peer = -1;
  int n = b->nranks;
  for (int r = 0; r < n; r++) fds[r] = -1;
  ep_status_t st = EP_OK;
  if (b->rank == 0) {
    st = root_gather(b, NULL, 0, fds, deadline);
    fds[0] = fd; /* sent as is; replaced by a private duplicate below */
    for (int r = 1; r < n && !st; r++) st = send_fds(b->socks[r], fds, n, deadline, r);
    fds[0] = -1;
    if (!st && (fds[0] = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
      st = ep_err(EP_ERR_SYSTEM, "bootstrap: dup: %s", strerror(errno));
  } else {
    st = send_fds(b->socks[0], &fd, 1, deadline, 0);
    if (!st) st = recv_fds(b->socks[0], fds, n, deadline, 0);
  }
  if (st) {
    for (int r = 0; r < n; r++)
      if (fds[r] >= 0) close(fds[r]), fds[r] = -1;
    ep_boot_abort(b, st);
  }
  return st;
}

ep_status_t ep_boot_barrier(ep_boot_t *b, double deadline) {
  char one = 1, *all = malloc((size_t)b->nranks);
  if (!all) return ep_err(EP_ERR_NO_MEMORY, "bootstrap: out of memory");
  ep_status_t st = ep_boot_allgather(b, &one, all, 1, deadline);
  free(all);
  return st;
}

int ep_boot_failed_peer(void) { return failed_peer; }

void ep_boot_abort(ep_boot_t *b, ep_status_t why) {
  if (!b->socks) return;
  int culprit = failed_peer >= 0 ? failed_peer : b->rank;
  frame_t f = {F_ABORT, (uint32_t)why, culprit, b->rank, 0};
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
