/* Authenticated bootstrap (issue 16, item 1), under `epcomm launch -n 2`. While rank 0 waits for
 * its peers on the abstract socket, rank 1 first sends four impostors at it:
 *   uid      a process of another uid (nobody; needs root to switch, else skipped with a reason)
 *            that sends a perfectly valid hello, secret included: SO_PEERCRED must refuse it;
 *   secret   a process of our uid that sends a well-formed hello without the job's secret;
 *   garbage  64 random bytes;
 *   silent   connects and sends nothing.
 * Rank 0 must drop the first three while it keeps waiting (rank 1 waits for their EOF before it
 * joins), and the silent one at the latest when the group is complete. None may receive a
 * single byte or file descriptor. Then the real job completes: a buffer and a round of data,
 * checked against the reference. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/bootstrap.h"
#include "core/secret.h"
#include "round.h"

enum { UID, SECRET, GARBAGE, SILENT, NIMP };
static const char *const kind_name[NIMP] = {"uid", "secret", "garbage", "silent"};

typedef struct {
  long bytes, fds;
  int eof, skipped;
} result_t;

static int connect_to(const char *name) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  int n = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "epcomm-%s", name);
  socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
  for (int i = 0; i < 5000; i++) { /* rank 0 may not listen yet: up to 10 s */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, len) == 0) return fd;
    if (fd >= 0) close(fd);
    nanosleep(&(struct timespec){0, 2000000}, NULL);
  }
  return -1;
}

/* Reads until EOF (or 20 s), counting bytes and received descriptors. */
static void drain(int fd, result_t *r) {
  for (int i = 0; i < 2000; i++) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    char buf[4096];
    union {
      char b[CMSG_SPACE(64 * sizeof(int))];
      struct cmsghdr align;
    } u;
    struct iovec iov = {buf, sizeof buf};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
    ssize_t n = recvmsg(fd, &m, 0);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); n >= 0 && c; c = CMSG_NXTHDR(&m, c))
      if (c->cmsg_type == SCM_RIGHTS) r->fds += (long)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    if (n <= 0) {
      r->eof = 1;
      return;
    }
    r->bytes += n;
  }
}

static _Noreturn void impostor(int kind, const char *name, const uint8_t key[32], int out) {
  result_t r = {0, 0, 0, 0};
  if (kind == UID && geteuid() != 0) {
    r.skipped = 1;
    (void)!write(out, "s", 1);
    (void)!write(out, &r, sizeof r);
    _exit(0);
  }
  if (kind == UID && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(3);
  int fd = connect_to(name);
  if (fd < 0) _exit(4);
  unsigned char msg[64];
  _Static_assert(EP_BOOT_HELLO_BYTES <= 64, "hello fits");
  size_t len = 0;
  if (kind == UID || kind == SECRET) {
    uint8_t k[32];
    memcpy(k, key, 32);
    if (kind == SECRET) k[0] ^= 1; /* any other secret */
    len = ep_boot_hello(msg, k, name, 1, 2);
  } else if (kind == GARBAGE) {
    t_rng g = t_seed((uint64_t)getpid(), 64);
    for (int i = 0; i < 64; i++) msg[i] = (unsigned char)t_next(&g);
    len = 64;
  }
  /* Rank 0 may have dropped us already (uid): EPIPE then, which is fine. */
  if (len && send(fd, msg, len, MSG_NOSIGNAL) != (ssize_t)len && errno != EPIPE &&
      errno != ECONNRESET)
    _exit(5);
  (void)!write(out, "s", 1);
  drain(fd, &r);
  (void)!write(out, &r, sizeof r);
  _exit(0);
}

static int read_full(int fd, void *p, size_t n) {
  for (size_t got = 0; got < n;) {
    struct pollfd q = {fd, POLLIN, 0};
    if (poll(&q, 1, 20000) <= 0) return -1;
    ssize_t k = read(fd, (char *)p + got, n - got);
    if (k <= 0) return -1;
    got += (size_t)k;
  }
  return 0;
}

static void check(int kind, const result_t *r) {
  if (r->skipped) {
    printf("skipped case: impostor of another uid (switching to nobody needs root)\n");
    return;
  }
  T_CHECK(r->eof && r->bytes == 0 && r->fds == 0,
          "impostor '%s' was not dropped cleanly: %ld bytes, %ld fds received, eof %d",
          kind_name[kind], r->bytes, r->fds, r->eof);
  printf("impostor '%s': dropped, received nothing\n", kind_name[kind]);
}

/* Rank 1: the four impostors, then the real join. */
static void send_impostors(ep_group_t *g) {
  char name[80];
  snprintf(name, sizeof name, "%s.0", getenv("EP_JOB_ID"));
  uint8_t key[32];
  ep_secret_key(getenv("EP_JOB_SECRET"), key);
  int pipes[NIMP][2];
  pid_t pids[NIMP];
  for (int k = 0; k < NIMP; k++) {
    T_CHECK(pipe(pipes[k]) == 0, "pipe");
    if ((pids[k] = fork()) == 0) impostor(k, name, key, pipes[k][1]);
    close(pipes[k][1]);
  }
  result_t res[NIMP];
  char c;
  for (int k = 0; k < NIMP; k++)
    if (read_full(pipes[k][0], &c, 1) != 0) {
      int ws = 0;
      waitpid(pids[k], &ws, 0);
      T_FAILF("impostor '%s' never connected (wait status %#x)", kind_name[k], ws);
    }
  /* Rank 0 must have dropped the three talkers while still waiting for us. */
  for (int k = 0; k < SILENT; k++)
    T_CHECK(read_full(pipes[k][0], &res[k], sizeof res[k]) == 0,
            "impostor '%s' was never dropped by rank 0", kind_name[k]);
  T_OK(ep_group_create_from_env(NULL, g));
  T_CHECK(read_full(pipes[SILENT][0], &res[SILENT], sizeof res[SILENT]) == 0,
          "the silent impostor was never dropped");
  for (int k = 0; k < NIMP; k++) {
    int ws;
    waitpid(pids[k], &ws, 0);
    T_CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "impostor '%s' failed (status %#x)",
            kind_name[k], ws);
    close(pipes[k][0]);
    check(k, &res[k]);
  }
}

int main(void) {
  const char *rank = getenv("EP_RANK");
  t_rank = rank ? atoi(rank) : -1;
  T_CHECK(getenv("EP_JOB_ID") && getenv("EP_JOB_SECRET"), "run me under epcomm launch -n 2");
  ep_group_t g;
  if (t_rank == 1)
    send_impostors(&g);
  else
    T_OK(ep_group_create_from_env(NULL, &g));
  int R, me;
  T_OK(ep_group_nranks(g, &R));
  T_OK(ep_group_rank(g, &me));
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, NULL, &b));
  long wrong;
  T_OK(t_round(b, R, me, 11, &wrong));
  T_CHECK(wrong == 0, "%ld values differ from the reference", wrong);
  T_OK(ep_buffer_destroy(b));
  T_OK(ep_group_destroy(g));
  printf("rank %d: the job completed (%d ranks, data match the reference)\n", me, R);
  return T_PASS;
}
