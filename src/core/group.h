/* The group object (core-private). */
#ifndef EP_CORE_GROUP_H
#define EP_CORE_GROUP_H

#include <stdatomic.h>

#include "bootstrap.h"
#include "internal.h"
#include "liveness.h"

#define EP_HOSTKEY_MAX 96

struct ep_group_s {
  uint32_t magic;
  ep_id_t id;
  int rank, nranks;
  double timeout_s;
  ep_boot_t boot;
  ep_live_t live;
  char (*hostkeys)[EP_HOSTKEY_MAX]; /* [nranks]: hostname + boot id */
  bool broken;                      /* a collective failed: destroy skips its barrier */
  pthread_mutex_t lock;             /* guards the buffer list */
  pthread_mutex_t boot_lock;        /* one exchange at a time on the bootstrap channel */
  ep_id_t *buffers;                 /* live buffers, for BUSY reports and release */
  int nbuffers, capbuffers;
  ep_errbox_t err;
};
typedef struct ep_group_s ep_group;

#define EP_GROUP_MAGIC 0x45504752u

/* Record a failure on the group and the calling thread; returns `st`. */
ep_status_t ep_group_fail(ep_group *g, ep_status_t st, const char *op);
/* Zero-timeout check; EP_ERR_PEER_FAILED with a message naming the rank and what happened. */
ep_status_t ep_group_check(ep_group *g, int *dead, const char **how);
bool ep_group_same_host(const ep_group *g);
/* After a failed exchange: if a peer is (about to be seen) dead, say so instead. */
ep_status_t ep_group_explain(ep_group *g, ep_status_t st);
ep_status_t ep_group_add_buffer(ep_group *g, ep_id_t buf);
void ep_group_remove_buffer(ep_group *g, ep_id_t buf);

#endif
