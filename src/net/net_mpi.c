/* The MPI engine: host memory across hosts through the MPI library the job already runs under.
 *
 * epcomm never links MPI. The library is opened with dlopen when the first endpoint of a group
 * that spans hosts is opened, and the few functions and predefined handles used here are
 * resolved with dlsym. Handles are those of Open MPI's ABI (libmpi.so.40: MPI_Comm and friends
 * are pointers, the predefined ones are the addresses of the ompi_mpi_* globals, MPI_Status is
 * three public ints and two private words); other MPI implementations have other ABIs and are
 * refused by name.
 *
 * MPI is a per-process singleton: it is initialized once and finalized once per process. So is
 * the record of it below (the only process-wide state of the net layer): whether epcomm
 * initialized it (then epcomm finalizes it when its last endpoint closes cleanly), the thread
 * level, and how many endpoints use it. A program that initialized MPI itself keeps it: epcomm
 * then neither initializes nor finalizes it.
 *
 * Every communicator epcomm creates is a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN,
 * so that a failed transfer comes back as an error instead of aborting the job; every wait is
 * the caller's loop over MPI_Test, with a deadline. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/backend.h"
#include "net/net.h"

/* ------------------------------------------------------------------ Open MPI's ABI */

typedef struct mpi_obj *mpi_handle_t; /* MPI_Comm, MPI_Datatype, MPI_Request, MPI_Errhandler */
typedef struct {
  int source, tag, error; /* MPI_SOURCE, MPI_TAG, MPI_ERROR */
  int cancelled_;         /* private to the library */
  size_t ucount_;
} mpi_status_t;
enum { MPI_OK = 0, THREAD_SERIALIZED = 2, THREAD_MULTIPLE = 3, ERR_STRING_MAX = 256 };

typedef struct {
  int (*Initialized)(int *);
  int (*Finalized)(int *);
  int (*Init_thread)(int *, char ***, int, int *);
  int (*Query_thread)(int *);
  int (*Finalize)(void);
  int (*Comm_idup)(mpi_handle_t, mpi_handle_t *, mpi_handle_t *);
  int (*Comm_free)(mpi_handle_t *);
  int (*Comm_set_errhandler)(mpi_handle_t, mpi_handle_t);
  int (*Comm_rank)(mpi_handle_t, int *);
  int (*Comm_size)(mpi_handle_t, int *);
  int (*Isend)(const void *, int, mpi_handle_t, int, int, mpi_handle_t, mpi_handle_t *);
  int (*Irecv)(void *, int, mpi_handle_t, int, int, mpi_handle_t, mpi_handle_t *);
  int (*Test)(mpi_handle_t *, int *, mpi_status_t *);
  int (*Cancel)(mpi_handle_t *);
  int (*Request_free)(mpi_handle_t *);
  int (*Get_count)(const mpi_status_t *, mpi_handle_t, int *);
  int (*Error_string)(int, char *, int *);
  /* predefined handles: addresses of the library's globals */
  mpi_handle_t comm_world, byte, errors_return, request_null;
} mpi_fns_t;

#define FN(name) \
  { "MPI_" #name, offsetof(mpi_fns_t, name) }
static const struct {
  const char *sym;
  size_t off;
} symbols[] = {
    FN(Initialized),
    FN(Finalized),
    FN(Init_thread),
    FN(Query_thread),
    FN(Finalize),
    FN(Comm_idup),
    FN(Comm_free),
    FN(Comm_set_errhandler),
    FN(Comm_rank),
    FN(Comm_size),
    FN(Isend),
    FN(Irecv),
    FN(Test),
    FN(Cancel),
    FN(Request_free),
    FN(Get_count),
    FN(Error_string),
    {"ompi_mpi_comm_world", offsetof(mpi_fns_t, comm_world)},
    {"ompi_mpi_byte", offsetof(mpi_fns_t, byte)},
    {"ompi_mpi_errors_return", offsetof(mpi_fns_t, errors_return)},
    {"ompi_request_null", offsetof(mpi_fns_t, request_null)},
};
#undef FN

static const char *const lib_names[] = {"libmpi.so.40", "libmpi.so", NULL};

/* ------------------------------------------------------------------ the process's MPI */

static struct {
  pthread_mutex_t lock; /* guards this record; with a thread level below MULTIPLE, every call */
  void *dl;
  char path[256];
  mpi_fns_t f;
  int users;      /* open endpoints */
  bool ours;      /* epcomm called MPI_Init_thread: it finalizes */
  bool serialize; /* thread level SERIALIZED: one MPI call at a time, under `lock` */
  bool failed;    /* an endpoint closed after a failure: MPI_Finalize could wait forever */
} rt = {PTHREAD_MUTEX_INITIALIZER, NULL, "", {0}, 0, false, false, false};

static void call_begin(void) {
  if (rt.serialize) pthread_mutex_lock(&rt.lock);
}
static void call_end(void) {
  if (rt.serialize) pthread_mutex_unlock(&rt.lock);
}

static const char *mpi_strerror(int code, char *buf) {
  int len = 0;
  if (!rt.f.Error_string || rt.f.Error_string(code, buf, &len) != MPI_OK)
    snprintf(buf, 64, "error %d", code);
  else
    buf[len < ERR_STRING_MAX ? len : ERR_STRING_MAX - 1] = '\0';
  return buf;
}

/* A predefined handle is the address of a library global; a program that links MPI itself may
 * hold a copy of that global (a copy relocation in the executable), which is then the one MPI
 * uses: the process's global scope is asked first, this library's handle second. */
static ep_status_t resolve(void *dl) {
  for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
    bool data = strncmp(symbols[i].sym, "MPI_", 4) != 0;
    void *p = data ? dlsym(RTLD_DEFAULT, symbols[i].sym) : NULL;
    if (!p) p = dlsym(dl, symbols[i].sym);
    if (!p)
      return ep_err(EP_ERR_UNSUPPORTED,
                    "%s has no symbol %s: the MPI engine needs Open MPI "
                    "(libmpi.so.40 ABI); set EP_MPI_LIB to an Open MPI library",
                    rt.path, symbols[i].sym);
    memcpy((char *)&rt.f + symbols[i].off, &p, sizeof p);
  }
  return EP_OK;
}

/* Initialize MPI unless someone did; refuse a level at which our calls would be unsafe. */
static ep_status_t init_mpi(void) {
  int inited = 0, finalized = 0, level = 0;
  rt.f.Finalized(&finalized);
  if (finalized)
    return ep_err(EP_ERR_UNSUPPORTED,
                  "MPI was already finalized in this process (MPI is "
                  "initialized once per process: epcomm finalizes it with its last multi-host "
                  "group when it initialized it; call MPI_Init_thread yourself before creating "
                  "groups to keep MPI for the whole process)");
  rt.f.Initialized(&inited);
  if (!inited) {
    int rc = rt.f.Init_thread(NULL, NULL, THREAD_MULTIPLE, &level);
    char why[ERR_STRING_MAX];
    if (rc != MPI_OK) return ep_err(EP_ERR_BOOTSTRAP, "MPI_Init_thread: %s", mpi_strerror(rc, why));
    rt.ours = true;
    /* Our world, our handler: a failed call returns instead of aborting the job. */
    rt.f.Comm_set_errhandler(rt.f.comm_world, rt.f.errors_return);
  } else {
    rt.f.Query_thread(&level);
  }
  if (level < THREAD_SERIALIZED)
    return ep_err(EP_ERR_UNSUPPORTED,
                  "MPI runs at thread level %d; epcomm calls MPI from the "
                  "thread of each epcomm call: initialize MPI with MPI_THREAD_SERIALIZED or "
                  "MPI_THREAD_MULTIPLE (MPI_Init_thread)",
                  level);
  rt.serialize = level < THREAD_MULTIPLE;
  return EP_OK;
}

/* The first user loads the library and initializes MPI; it stays loaded (RTLD_NODELETE): Open
 * MPI leaves exit-time handlers behind that must not point into unmapped code. */
static ep_status_t runtime_acquire(void) {
  pthread_mutex_lock(&rt.lock);
  ep_status_t st = EP_OK;
  if (!rt.dl) {
    void *dl = ep_net_dlopen("EP_MPI_LIB", lib_names, rt.path, sizeof rt.path);
    st = dl ? resolve(dl) : EP_ERR_UNSUPPORTED;
    if (dl && st)
      dlclose(dl);
    else if (dl)
      rt.dl = dl, dlopen(rt.path, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
  }
  if (!st && rt.users == 0) st = init_mpi();
  if (!st) rt.users++;
  pthread_mutex_unlock(&rt.lock);
  return st;
}

static void runtime_release(bool clean) {
  pthread_mutex_lock(&rt.lock);
  if (!clean) rt.failed = true;
  /* After a failure a peer may be gone: MPI_Finalize would wait for it. The process is failing
   * anyway; its launcher reports the job. */
  if (--rt.users == 0 && rt.ours && !rt.failed) {
    rt.f.Finalize();
    rt.ours = false;
  }
  pthread_mutex_unlock(&rt.lock);
}

/* ------------------------------------------------------------------ endpoints */

struct ep_net {
  mpi_handle_t comm;
  int rank, nranks;
};

static ep_status_t mpi_probe(void) {
  char path[256];
  void *dl = ep_net_dlopen("EP_MPI_LIB", lib_names, path, sizeof path);
  if (!dl) return EP_ERR_UNSUPPORTED;
  bool ok = dlsym(dl, "ompi_mpi_comm_world") && dlsym(dl, "MPI_Init_thread");
  dlclose(dl);
  return ok ? EP_OK
            : ep_err(EP_ERR_UNSUPPORTED,
                     "%s is not Open MPI (no ompi_mpi_comm_world): the MPI "
                     "engine needs the libmpi.so.40 ABI",
                     path);
}

/* MPI_Comm_idup, bounded: a rank that never arrives must not hang the others. */
static ep_status_t dup_world(const ep_net_open_t *how, mpi_handle_t *comm) {
  mpi_handle_t req;
  char why[ERR_STRING_MAX];
  call_begin();
  int rc = rt.f.Comm_idup(rt.f.comm_world, comm, &req);
  call_end();
  if (rc != MPI_OK) return ep_err(EP_ERR_BOOTSTRAP, "MPI_Comm_idup: %s", mpi_strerror(rc, why));
  ep_net_xfer_t x = {.peer = -1, .send = 1, .req = req}; /* .send: no count to read */
  ep_status_t st = ep_net_wait(ep_net_mpi(), NULL, &x, 1, how->deadline, how->deadline - ep_now(),
                               NULL, NULL, "duplicating MPI_COMM_WORLD");
  if (st)
    return st == EP_ERR_TIMEOUT ? ep_err(st,
                                         "MPI_Comm_idup(MPI_COMM_WORLD): not every "
                                         "rank arrived before the deadline")
                                : st;
  call_begin();
  rt.f.Comm_set_errhandler(*comm, rt.f.errors_return);
  call_end();
  return EP_OK;
}

static ep_status_t mpi_open(const ep_net_open_t *how, ep_net_t **out) {
  ep_status_t st = runtime_acquire();
  if (st) return st;
  ep_net_t *n = calloc(1, sizeof *n);
  if (!n) st = ep_err(EP_ERR_NO_MEMORY, "out of memory");
  if (!st) st = dup_world(how, &n->comm);
  if (!st) {
    call_begin();
    rt.f.Comm_rank(n->comm, &n->rank);
    rt.f.Comm_size(n->comm, &n->nranks);
    call_end();
    if (n->nranks != how->nranks || n->rank != how->rank)
      st = ep_err(EP_ERR_MISMATCH,
                  "MPI_COMM_WORLD is rank %d of %d but the group says rank %d "
                  "of %d: a group that spans hosts must span MPI_COMM_WORLD, in its order",
                  n->rank, n->nranks, how->rank, how->nranks);
  }
  if (st) {
    if (n && n->comm) rt.f.Comm_free(&n->comm);
    free(n);
    runtime_release(false);
    return st;
  }
  *out = n;
  return EP_OK;
}

static void mpi_close(ep_net_t *n, bool clean) {
  if (!n) return;
  call_begin();
  rt.f.Comm_free(&n->comm);
  call_end();
  free(n);
  runtime_release(clean);
}

static ep_status_t mpi_post(ep_net_t *n, ep_net_xfer_t *x, int count, void *stream) {
  (void)stream;
  for (int i = 0; i < count; i++) {
    if (x[i].bytes > INT_MAX) {
      ep_net_mpi()->cancel(n, x, i);
      return ep_err(EP_ERR_TOO_LARGE, "one MPI transfer of %zu bytes: at most %d", x[i].bytes,
                    INT_MAX);
    }
    mpi_handle_t req;
    call_begin();
    int rc =
        x[i].send
            ? rt.f.Isend(x[i].buf, (int)x[i].bytes, rt.f.byte, x[i].peer, x[i].tag, n->comm, &req)
            : rt.f.Irecv(x[i].buf, (int)x[i].bytes, rt.f.byte, x[i].peer, x[i].tag, n->comm, &req);
    call_end();
    if (rc != MPI_OK) {
      char why[ERR_STRING_MAX];
      ep_net_mpi()->cancel(n, x, i);
      return ep_err(EP_ERR_SYSTEM, "MPI_%s with rank %d: %s", x[i].send ? "Isend" : "Irecv",
                    x[i].peer, mpi_strerror(rc, why));
    }
    x[i].req = req, x[i].done = 0, x[i].got = 0;
  }
  return EP_OK;
}

static ep_status_t mpi_test(ep_net_t *n, ep_net_xfer_t *x, int count, int *ndone) {
  (void)n;
  int d = 0;
  for (int i = 0; i < count; i++) {
    if (x[i].done) {
      d++;
      continue;
    }
    mpi_handle_t req = x[i].req;
    mpi_status_t s;
    int flag = 0, got = 0;
    call_begin();
    int rc = rt.f.Test(&req, &flag, &s);
    if (rc == MPI_OK && flag && !x[i].send) rt.f.Get_count(&s, rt.f.byte, &got);
    call_end();
    if (rc != MPI_OK) {
      char why[ERR_STRING_MAX];
      x[i].req = req;
      return ep_err(EP_ERR_PEER_FAILED, "MPI %s with rank %d failed: %s",
                    x[i].send ? "send" : "receive", x[i].peer, mpi_strerror(rc, why));
    }
    x[i].req = req;
    if (flag) x[i].done = 1, x[i].got = (size_t)got, d++;
  }
  *ndone = d;
  return EP_OK;
}

static void mpi_cancel(ep_net_t *n, ep_net_xfer_t *x, int count) {
  (void)n;
  call_begin();
  for (int i = 0; i < count; i++) {
    if (x[i].done || !x[i].req || x[i].req == rt.f.request_null) continue;
    mpi_handle_t req = x[i].req;
    if (!x[i].send) rt.f.Cancel(&req);
    rt.f.Request_free(&req);
    x[i].req = NULL;
    x[i].done = 1;
  }
  call_end();
}

/* At SERIALIZED the program may rely on one MPI call at a time among its threads, which a thread
 * of ours would break; at MULTIPLE anything goes. */
static bool mpi_own_threads_ok(void) {
  pthread_mutex_lock(&rt.lock);
  int finalized = 1;
  bool ok = rt.users > 0 && !rt.serialize && rt.f.Finalized &&
            rt.f.Finalized(&finalized) == MPI_OK && !finalized;
  pthread_mutex_unlock(&rt.lock);
  return ok;
}

static const struct ep_net_engine mpi_engine = {
    .name = "mpi",
    .device_memory = false,
    .probe = mpi_probe,
    .open = mpi_open,
    .close = mpi_close,
    .post = mpi_post,
    .test = mpi_test,
    .cancel = mpi_cancel,
    .own_threads_ok = mpi_own_threads_ok,
};

const struct ep_net_engine *ep_net_mpi(void) {
  return &mpi_engine;
}
