/* Hosts of a group (core-private; backends see the result, ep_topo_t, through backend.h). */
#ifndef EP_CORE_TOPO_H
#define EP_CORE_TOPO_H

#include "internal.h"

/* What a rank says about where it runs, gathered from every rank at group creation. */
typedef struct {
  int32_t pid;
  int32_t hosts;    /* EP_HOSTS (1 when unset) */
  int32_t has_id;   /* EP_HOST_ID is set */
  int32_t beat_ms;  /* across hosts: this rank's heartbeat limit (EP_HEARTBEAT_S), 0: it cannot or
                       will not beat; the group takes the largest, or none if any rank has 0 */
  char hostkey[96]; /* the machine: hostname/boot id */
  char host_id[64]; /* EP_HOST_ID */
} ep_ident_t;

void ep_ident_fill(ep_ident_t *me, const char *hostkey);
/* This rank asks for hosts other than its machine (EP_HOST_ID, or EP_HOSTS > 1). */
bool ep_ident_wants_hosts(const ep_ident_t *me);
/* The hosts from every rank's identity; errors name the rank(s) and the rule broken. */
ep_status_t ep_topo_build(const ep_ident_t *all, int R, int me, ep_topo_t *t);
/* One host holding all R ranks. */
ep_status_t ep_topo_single(int R, int me, ep_topo_t *t);
void ep_topo_free(ep_topo_t *t);

#endif
