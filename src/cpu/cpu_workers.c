/* Channel workers: channel 0 runs on the caller's thread, channels 1..C-1 on threads created
 * with the buffer and joined by its destroy (never per call). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

static void finish_channel(cpu_state_t *s, ep_status_t st) {
  pthread_mutex_lock(&s->pool_lock);
  if (st && !s->job_status) {
    s->job_status = st;
    s->job_err_set = true;
    snprintf(s->job_err, sizeof s->job_err, "%s", ep_last_error());
  }
  if (st) atomic_store(&s->local_abort, 1);
  if (--s->job_pending == 0) pthread_cond_broadcast(&s->pool_cond);
  pthread_mutex_unlock(&s->pool_lock);
}

static void *worker_main(void *arg) {
  cpu_worker_t *w = arg;
  cpu_state_t *s = w->s;
  uint64_t done = 0;
  for (;;) {
    pthread_mutex_lock(&s->pool_lock);
    while (!s->pool_stop && s->job_gen == done) pthread_cond_wait(&s->pool_cond, &s->pool_lock);
    if (s->pool_stop) {
      pthread_mutex_unlock(&s->pool_lock);
      return NULL;
    }
    done = s->job_gen;
    void *job = s->job;
    ep_status_t (*fn)(cpu_state_t *, void *, int) = s->job_fn;
    pthread_mutex_unlock(&s->pool_lock);
    finish_channel(s, fn(s, job, w->channel));
  }
}

ep_status_t cpu_workers_start(cpu_state_t *s) {
  pthread_mutex_init(&s->pool_lock, NULL);
  pthread_cond_init(&s->pool_cond, NULL);
  if (s->channels <= 1) return EP_OK;
  s->workers = calloc((size_t)s->channels, sizeof *s->workers);
  if (!s->workers) return ep_err(EP_ERR_NO_MEMORY, "out of memory");
  for (int c = 1; c < s->channels; c++) {
    s->workers[c].s = s;
    s->workers[c].channel = c;
    int rc = pthread_create(&s->workers[c].thread, NULL, worker_main, &s->workers[c]);
    if (rc) {
      s->workers[c].s = NULL;
      return ep_err(EP_ERR_SYSTEM, "pthread_create for channel %d: %s", c, strerror(rc));
    }
  }
  return EP_OK;
}

void cpu_workers_stop(cpu_state_t *s) {
  if (s->workers) {
    pthread_mutex_lock(&s->pool_lock);
    s->pool_stop = true;
    pthread_cond_broadcast(&s->pool_cond);
    pthread_mutex_unlock(&s->pool_lock);
    for (int c = 1; c < s->channels; c++)
      if (s->workers[c].s) pthread_join(s->workers[c].thread, NULL);
    free(s->workers);
    s->workers = NULL;
  }
  pthread_cond_destroy(&s->pool_cond);
  pthread_mutex_destroy(&s->pool_lock);
}

ep_status_t cpu_run_channels(cpu_state_t *s, ep_status_t (*fn)(cpu_state_t *, void *, int),
                             void *job) {
  atomic_store(&s->local_abort, 0);
  if (s->channels == 1) return fn(s, job, 0);
  pthread_mutex_lock(&s->pool_lock);
  s->job = job;
  s->job_fn = fn;
  s->job_status = EP_OK;
  s->job_err_set = false;
  s->job_pending = s->channels;
  s->job_gen++;
  pthread_cond_broadcast(&s->pool_cond);
  pthread_mutex_unlock(&s->pool_lock);
  finish_channel(s, fn(s, job, 0));
  pthread_mutex_lock(&s->pool_lock);
  while (s->job_pending > 0) pthread_cond_wait(&s->pool_cond, &s->pool_lock);
  ep_status_t st = s->job_status;
  pthread_mutex_unlock(&s->pool_lock);
  /* The first failing channel's message is the one the caller sees. */
  if (st && s->job_err_set) ep_err(st, "%s", s->job_err);
  return st;
}
