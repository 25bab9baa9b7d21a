/* Bootstrap internals shared by bootstrap.c (frames, exchanges) and boot_open.c (rendezvous,
 * authentication): bounded socket I/O that watches the group's liveness while it waits. */
#ifndef EP_CORE_BOOT_IO_H
#define EP_CORE_BOOT_IO_H

#include <stdbool.h>

#include "bootstrap.h"

/* Remember the rank at fault for the abort frame and return ep_err(st, ...). */
ep_status_t ep_bio_fail(ep_status_t st, int peer, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Zero-timeout liveness check: EP_ERR_PEER_FAILED naming the dead rank (or the launcher). */
ep_status_t ep_bio_watch(ep_boot_t *b);
/* Waits until fd is ready for `events`, the deadline passes (EP_ERR_TIMEOUT naming `peer`) or a
 * rank dies. */
ep_status_t ep_bio_wait(ep_boot_t *b, int fd, short events, double deadline, int peer);
ep_status_t ep_bio_write(ep_boot_t *b, int fd, const void *buf, size_t len, double deadline,
                         int peer);
ep_status_t ep_bio_read(ep_boot_t *b, int fd, void *buf, size_t len, double deadline, int peer);
int ep_bio_ms_left(double deadline, int cap_ms);

#endif
