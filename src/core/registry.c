/* Object registry: the process-wide table behind every opaque handle.
 *
 * Why a table and not raw pointers: a destroyed object's memory is gone, so the only way to answer
 * a double destroy or a use-after-destroy with EP_ERR_DESTROYED instead of undefined behaviour is
 * to hand out ids whose slot remembers a generation. The same table counts calls in flight
 * (EP_ERR_BUSY on overlap or on destroy during a call) and names the objects still alive at exit.
 * This is epcomm's only process-wide mutable state besides the logger; it is guarded by one mutex.
 *
 * Every object remembers the process that created it. After fork() the child holds copies of the
 * parent's objects whose peers, segments and threads belong to the parent: any use of them in the
 * child is refused (EP_ERR_FORKED) before it can touch what the parent shares with its peers, and
 * the exit report leaves them out (they are the parent's to destroy).
 *
 * id layout: bits 0..23 slot index + 1, bits 24..63 generation (never 0). */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

/* An id: kind (3 bits) | generation (37 bits) | slot index + 1 (24 bits). The kind travels in
 * the id so that a stale id of one kind passed where another is expected is named for what it
 * was, even after its slot went to an object of another kind. */
#define SLOT_BITS 24
#define SLOT_MASK ((1ull << SLOT_BITS) - 1)
#define KIND_SHIFT 61
#define GEN_MASK ((1ull << (KIND_SHIFT - SLOT_BITS)) - 1)

typedef struct {
  uint64_t gen; /* generation of the live object, or of the last one */
  void *obj;
  int kind; /* 0: free */
  int inflight;
  bool exclusive;
  int next_free;
  int rank;  /* for the exit report */
  pid_t pid; /* the process that created it */
} slot_t;

static struct {
  pthread_mutex_t lock;
  slot_t *slots;
  int cap, used, free_head;
  unsigned env_groups;
  pthread_once_t once;
  pid_t pid; /* this process: set at first use and in every forked child */
} reg = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, -1, 0, PTHREAD_ONCE_INIT, 0};

/* The lock is held across fork(), so that the child never inherits it locked by a thread that
 * does not exist there (its exit report would wait for it forever). */
static void fork_prepare(void) {
  pthread_mutex_lock(&reg.lock);
}
static void fork_parent(void) {
  pthread_mutex_unlock(&reg.lock);
}
static void fork_child(void) {
  reg.pid = getpid();
  pthread_mutex_unlock(&reg.lock);
}

static void reg_init(void) {
  reg.pid = getpid();
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static const char *kind_name(int kind) {
  return kind == EP_OBJ_GROUP    ? "group"
         : kind == EP_OBJ_BUFFER ? "buffer"
         : kind == EP_OBJ_HANDLE ? "handle"
         : kind == EP_OBJ_MEM    ? "memory registration"
                                 : "low-latency handle";
}

static int slot_alloc(void) {
  if (reg.free_head >= 0) {
    int i = reg.free_head;
    reg.free_head = reg.slots[i].next_free;
    return i;
  }
  if (reg.used == reg.cap) {
    int cap = reg.cap ? reg.cap * 2 : 64;
    if ((uint64_t)cap > SLOT_MASK) return -1;
    slot_t *s = realloc(reg.slots, (size_t)cap * sizeof *s);
    if (!s) return -1;
    reg.slots = s;
    reg.cap = cap;
  }
  reg.slots[reg.used].gen = 0;
  return reg.used++;
}

ep_status_t ep_reg_add(enum ep_obj_kind kind, void *obj, int rank, ep_id_t *id) {
  pthread_once(&reg.once, reg_init);
  pthread_mutex_lock(&reg.lock);
  int i = slot_alloc();
  if (i < 0) {
    pthread_mutex_unlock(&reg.lock);
    return ep_err(EP_ERR_NO_MEMORY, "object registry: cannot grow");
  }
  slot_t *s = &reg.slots[i];
  s->gen++;
  s->obj = obj;
  s->kind = kind;
  s->inflight = 0;
  s->exclusive = false;
  s->rank = rank;
  s->pid = reg.pid;
  *id = ((uint64_t)kind << KIND_SHIFT) | ((s->gen & GEN_MASK) << SLOT_BITS) | (uint64_t)(i + 1);
  pthread_mutex_unlock(&reg.lock);
  return EP_OK;
}

/* Called with the lock held. */
static ep_status_t slot_find(ep_id_t id, enum ep_obj_kind kind, slot_t **out) {
  uint64_t idx = id & SLOT_MASK, gen = (id >> SLOT_BITS) & GEN_MASK;
  int idkind = (int)(id >> KIND_SHIFT);
  if (id == 0) return ep_err(EP_ERR_NULL_ARG, "%s is NULL", kind_name(kind));
  if (idx == 0 || idx > (uint64_t)reg.used || gen == 0 || idkind < EP_OBJ_GROUP ||
      idkind > EP_OBJ_MEM)
    return ep_err(EP_ERR_INVALID_ARG, "%s: not an epcomm %s", kind_name(kind), kind_name(kind));
  slot_t *s = &reg.slots[idx - 1];
  if (idkind != (int)kind)
    return ep_err(EP_ERR_INVALID_ARG, "%s: this is an epcomm %s%s, not a %s", kind_name(kind),
                  s->gen == gen && s->kind ? "" : "destroyed ", kind_name(idkind), kind_name(kind));
  if ((s->gen & GEN_MASK) != gen || s->kind == 0) {
    if ((s->gen & GEN_MASK) >= gen)
      return ep_err(EP_ERR_DESTROYED, "%s was already destroyed", kind_name(kind));
    return ep_err(EP_ERR_INVALID_ARG, "%s: not an epcomm %s", kind_name(kind), kind_name(kind));
  }
  if (s->kind != (int)kind)
    return ep_err(EP_ERR_INVALID_ARG, "%s: this is an epcomm %s, not a %s", kind_name(kind),
                  kind_name(s->kind), kind_name(kind));
  if (s->pid != reg.pid)
    return ep_err(EP_ERR_FORKED,
                  "%s was created by pid %d, used after fork in pid %d (a forked "
                  "child must create its own epcomm objects)",
                  kind_name(kind), (int)s->pid, (int)reg.pid);
  *out = s;
  return EP_OK;
}

ep_status_t ep_reg_acquire(ep_id_t id, enum ep_obj_kind kind, bool exclusive, void **obj) {
  pthread_mutex_lock(&reg.lock);
  slot_t *s;
  ep_status_t st = slot_find(id, kind, &s);
  if (st == EP_OK && (s->exclusive || (exclusive && s->inflight > 0)))
    st = ep_err(EP_ERR_BUSY,
                "%s is in use by another call in flight (calls on one %s must not "
                "overlap)",
                kind_name(kind), kind_name(kind));
  if (st == EP_OK) {
    s->inflight++;
    s->exclusive = exclusive;
    *obj = s->obj;
  }
  pthread_mutex_unlock(&reg.lock);
  return st;
}

void ep_reg_release(ep_id_t id) {
  pthread_mutex_lock(&reg.lock);
  slot_t *s = &reg.slots[(id & SLOT_MASK) - 1];
  s->inflight--;
  s->exclusive = false;
  pthread_mutex_unlock(&reg.lock);
}

ep_status_t ep_reg_remove(ep_id_t id, enum ep_obj_kind kind, void **obj) {
  pthread_mutex_lock(&reg.lock);
  slot_t *s;
  ep_status_t st = slot_find(id, kind, &s);
  if (st == EP_OK && s->inflight > 0)
    st = ep_err(EP_ERR_BUSY, "%s cannot be destroyed: a call on it is in flight", kind_name(kind));
  if (st == EP_OK) {
    *obj = s->obj;
    s->obj = NULL;
    s->kind = 0;
    int i = (int)(s - reg.slots);
    s->next_free = reg.free_head;
    reg.free_head = i;
  }
  pthread_mutex_unlock(&reg.lock);
  return st;
}

int ep_reg_count(enum ep_obj_kind kind) {
  pthread_mutex_lock(&reg.lock);
  int n = 0;
  for (int i = 0; i < reg.used; i++) n += reg.slots[i].kind == (int)kind;
  pthread_mutex_unlock(&reg.lock);
  return n;
}

ep_id_t ep_reg_sole(enum ep_obj_kind kind) {
  pthread_mutex_lock(&reg.lock);
  ep_id_t id = 0;
  int n = 0;
  for (int i = 0; i < reg.used; i++) {
    slot_t *s = &reg.slots[i];
    if (s->kind != (int)kind || s->pid != reg.pid) continue;
    n++;
    id = ((uint64_t)s->kind << KIND_SHIFT) | ((s->gen & GEN_MASK) << SLOT_BITS) | (uint64_t)(i + 1);
  }
  pthread_mutex_unlock(&reg.lock);
  return n == 1 ? id : 0;
}

unsigned ep_reg_next_env_group(void) {
  pthread_mutex_lock(&reg.lock);
  unsigned n = reg.env_groups++;
  pthread_mutex_unlock(&reg.lock);
  return n;
}

/* At exit: name what the program did not destroy. Local and read-only: never collective, never
 * frees (peers may still be running; the kernel reclaims memory and fds of a dying process). */
__attribute__((destructor)) static void ep_reg_report_at_exit(void) {
  pthread_mutex_lock(&reg.lock);
  int live = 0;
  for (int i = 0; i < reg.used; i++) {
    slot_t *s = &reg.slots[i];
    if (s->kind != 0 && s->pid != reg.pid) { /* the parent's, in a forked child: not ours */
      live++; /* kept reachable all the same: a leak checker must not blame the child */
      continue;
    }
    if (s->kind == EP_OBJ_HANDLE || s->kind == EP_OBJ_LL_HANDLE || s->kind == EP_OBJ_MEM) live++;
    if (s->kind != EP_OBJ_GROUP && s->kind != EP_OBJ_BUFFER) continue;
    unsigned long long id =
        ((uint64_t)s->kind << KIND_SHIFT) | ((s->gen & GEN_MASK) << SLOT_BITS) | (uint64_t)(i + 1);
    live++;
    if (s->kind == EP_OBJ_GROUP)
      ep_log_at(EP_LOG_WARN, s->rank, "exit",
                "group %#llx was not destroyed before exit; call "
                "ep_group_destroy()",
                id);
    else
      ep_log_at(EP_LOG_WARN, s->rank, "exit",
                "buffer %#llx was not destroyed before exit; call "
                "ep_buffer_destroy() before the group and before exit",
                id);
  }
  if (live == 0) { /* nothing alive: hand the table back so leak checkers see nothing */
    free(reg.slots);
    reg.slots = NULL;
    reg.cap = reg.used = 0;
    reg.free_head = -1;
  }
  pthread_mutex_unlock(&reg.lock);
}
