/* Single-producer single-consumer byte queues in shared memory. Positions only grow; a record
 * that would straddle the end of the ring starts at the beginning instead, by a rule both sides
 * compute from the position and the record size alone. */
#include "cpu.h"

/* Position at which a record of `rec` bytes written at `pos` really starts. */
static inline uint64_t place(uint64_t pos, size_t rec, size_t cap) {
  uint64_t off = pos % cap;
  return off + rec > cap ? pos + (cap - off) : pos;
}

void cpu_q_open_send(cpu_q_t *q, cpu_ring_t *r, size_t cap) {
  q->ring = r;
  q->cap = cap;
  q->pos = atomic_load_explicit(&r->tail, memory_order_relaxed); /* only we write it */
  q->other = atomic_load_explicit(&r->head, memory_order_acquire);
}

void cpu_q_open_recv(cpu_q_t *q, cpu_ring_t *r, size_t cap) {
  q->ring = r;
  q->cap = cap;
  q->pos = atomic_load_explicit(&r->head, memory_order_relaxed); /* only we write it */
  q->other = atomic_load_explicit(&r->tail, memory_order_acquire);
}

unsigned char *cpu_q_reserve(cpu_q_t *q, size_t rec) {
  uint64_t at = place(q->pos, rec, q->cap);
  if (at + rec - q->other > q->cap) {
    q->other = atomic_load_explicit(&q->ring->head, memory_order_acquire);
    if (at + rec - q->other > q->cap) return NULL;
  }
  return q->ring->data + at % q->cap;
}

void cpu_q_commit(cpu_q_t *q, size_t rec) {
  q->pos = place(q->pos, rec, q->cap) + rec;
}

void cpu_q_publish(cpu_q_t *q) {
  atomic_store_explicit(&q->ring->tail, q->pos, memory_order_release);
}

const unsigned char *cpu_q_peek(cpu_q_t *q, size_t rec) {
  uint64_t at = place(q->pos, rec, q->cap);
  if (at + rec > q->other) {
    q->other = atomic_load_explicit(&q->ring->tail, memory_order_acquire);
    if (at + rec > q->other) return NULL;
  }
  return q->ring->data + at % q->cap;
}

void cpu_q_consume(cpu_q_t *q, size_t rec) {
  q->pos = place(q->pos, rec, q->cap) + rec;
}

void cpu_q_release(cpu_q_t *q) {
  atomic_store_explicit(&q->ring->head, q->pos, memory_order_release);
}
