/* Registrations of caller memory (ep_register_memory, ep_deregister_memory). Each is a collective
 * call of the buffer's group, numbered on its bootstrap channel like a buffer's create and
 * destroy, so that ranks in different calls fail with EP_ERR_MISMATCH. The core keeps the slot
 * table (the lowest free slot: the same on every rank, since every rank makes the same calls,
 * and compared in the call's first exchange) and the ranges; the backend maps the memory
 * (ops->mem_register) or, without that op, nothing happens beyond the record. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"

#define EP_MEM_MAGIC 0x4550524du

struct ep_mem_s {
  uint32_t magic;
  ep_id_t id, buffer_id;
  int slot;
  void *ptr;
  size_t bytes;
};
typedef struct ep_mem_s ep_mem;

static int free_slot(const ep_buffer *b) {
  for (int i = 0; i < EP_MAX_MEM_REGS; i++)
    if (!b->mems[i]) return i;
  return -1;
}

static void mem_free(ep_mem *m) {
  if (!m) return;
  m->magic = 0;
  free(m);
}

/* The call's first exchange: every rank's slot. A rank that rejected its call (mine) takes part
 * all the same, so that the peers fail at once with EP_ERR_PEER_INVALID. Ranks naming different
 * slots disagree on which registration the call is about: EP_ERR_MISMATCH on every rank. */
static ep_status_t agree_slot(ep_buffer *b, const char *op, const char *verb, int slot,
                              ep_status_t mine) {
  ep_group *g = b->group;
  int32_t me = slot, *all = calloc((size_t)g->nranks, sizeof *all);
  if (!all) return mine ? mine : ep_err(EP_ERR_NO_MEMORY, "%s: out of memory", op);
  /* The same size on every rank, a rejecting one included (a size mismatch would break the
   * group). */
  ep_status_t st =
      ep_group_xchg(g, EP_XCHG_BYTES, &me, all, sizeof me, -1, NULL, mine, b->timeout_s);
  for (int r = 0; r < g->nranks && !st; r++)
    if (all[r] != me)
      st = ep_err(EP_ERR_MISMATCH,
                  "%s: this rank %s its registration #%d, rank %d its #%d (every rank must "
                  "register and deregister in the same order)",
                  op, verb, me, r, all[r]);
  free(all);
  return st;
}

/* After the call: a timeout or a dead peer leaves the buffer in doubt (broken); the other
 * failures happened alike on every rank and leave it usable. */
static ep_status_t after(ep_buffer *b, ep_status_t st, const char *op) {
  if (st == EP_ERR_TIMEOUT || st == EP_ERR_PEER_FAILED || st == EP_ERR_INTERNAL)
    return ep_buffer_after(b, st, op);
  if (st) {
    ep_err_prefix(op);
    ep_errbox_put(&b->err, ep_last_error());
  }
  return st;
}

static ep_status_t check_range(const ep_buffer *b, void *ptr, size_t bytes, const ep_mem_t *out,
                               int slot, const char *op) {
  if (!out) return ep_err(EP_ERR_NULL_ARG, "%s: mem is NULL", op);
  if (!ptr) return ep_err(EP_ERR_NULL_ARG, "%s: ptr is NULL", op);
  if (bytes == 0) return ep_err(EP_ERR_OUT_OF_RANGE, "%s: bytes is 0", op);
  if ((uintptr_t)ptr + bytes < (uintptr_t)ptr)
    return ep_err(EP_ERR_OUT_OF_RANGE, "%s: ptr %p + bytes %zu wraps around the address space", op,
                  ptr, bytes);
  if (slot < 0)
    return ep_err(EP_ERR_TOO_LARGE,
                  "%s: the buffer holds %d registrations already (deregister one)", op,
                  EP_MAX_MEM_REGS);
  (void)b;
  return EP_OK;
}

/* This rank's record, made before the exchange so that nothing local can fail after it. */
static ep_status_t new_record(ep_buffer *b, void *ptr, size_t bytes, int slot, ep_mem **out) {
  ep_mem *m = calloc(1, sizeof *m);
  if (!m) return ep_err(EP_ERR_NO_MEMORY, "ep_register_memory: out of memory");
  *m = (ep_mem){EP_MEM_MAGIC, 0, b->id, slot, ptr, bytes};
  ep_status_t st = ep_reg_add(EP_OBJ_MEM, m, b->group->rank, &m->id);
  if (st) {
    mem_free(m);
    return st;
  }
  *out = m;
  return EP_OK;
}

static void drop_record(ep_mem *m) {
  void *obj;
  if (m && ep_reg_remove(m->id, EP_OBJ_MEM, &obj) == EP_OK) mem_free(obj);
}

ep_status_t ep_register_memory(ep_buffer_t buffer, void *ptr, size_t bytes, ep_mem_t *mem) {
  static const char op[] = "ep_register_memory";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  const int slot = free_slot(b);
  ep_mem *m = NULL;
  ep_status_t mine = check_range(b, ptr, bytes, mem, slot, op);
  if (!mine) mine = new_record(b, ptr, bytes, slot, &m);
  ep_group *g = b->group;
  st = ep_group_call_begin(g, EP_OP_MEM_REGISTER);
  if (!st) st = agree_slot(b, op, "makes", slot, mine);
  if (!st && b->ops->mem_register) st = b->ops->mem_register(b->state, slot, ptr, bytes);
  ep_group_call_end(g);
  if (st) {
    drop_record(m);
  } else {
    b->mems[slot] = m->id;
    *mem = ep_id_to_ptr(m->id);
    EP_LOG(&b->ctx, EP_LOG_INFO, "init", "memory %p + %zu registered as #%d", ptr, bytes, slot);
  }
  st = after(b, st, op);
  ep_buffer_put(b);
  return st;
}

/* The registration `mem` names, if it is one of this buffer's; its slot, else -1 and a status. */
static ep_status_t find_mem(ep_buffer *b, ep_mem_t mem, const char *op, int *slot) {
  *slot = -1;
  ep_mem *m;
  ep_status_t st = ep_reg_acquire(ep_ptr_to_id(mem), EP_OBJ_MEM, false, (void **)&m);
  if (st) return ep_err_named(st, op, "mem");
  if (m->buffer_id != b->id)
    st = ep_err(EP_ERR_INVALID_ARG, "%s: mem was registered with another buffer", op);
  else
    *slot = m->slot;
  ep_reg_release(m->id);
  return st;
}

ep_status_t ep_deregister_memory(ep_buffer_t buffer, ep_mem_t mem) {
  static const char op[] = "ep_deregister_memory";
  ep_buffer *b;
  ep_status_t st = ep_buffer_get(buffer, op, &b);
  if (st) return st;
  int slot;
  ep_status_t mine = mem ? find_mem(b, mem, op, &slot)
                         : (slot = -1, ep_err(EP_ERR_NULL_ARG, "%s: mem is NULL", op));
  ep_group *g = b->group;
  st = ep_group_call_begin(g, EP_OP_MEM_DEREGISTER);
  if (!st) st = agree_slot(b, op, "undoes", slot, mine);
  if (!st) {
    if (b->ops->mem_deregister) st = b->ops->mem_deregister(b->state, slot);
    void *obj; /* this rank's part is undone whatever the peers say */
    if (ep_reg_remove(b->mems[slot], EP_OBJ_MEM, &obj) == EP_OK) mem_free(obj);
    b->mems[slot] = 0;
  }
  ep_group_call_end(g);
  st = after(b, st, op);
  ep_buffer_put(b);
  return st;
}

void ep_mem_drop_all(ep_buffer *b) {
  for (int i = 0; i < EP_MAX_MEM_REGS; i++) {
    void *obj;
    if (b->mems[i] && ep_reg_remove(b->mems[i], EP_OBJ_MEM, &obj) == EP_OK) mem_free(obj);
    b->mems[i] = 0;
  }
}
