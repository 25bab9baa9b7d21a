/* Public introspection of the backends: names, and whether buffers of one can be created here.
 * (The environment registry's public calls are in env.c.) */
#include <strings.h>

#include "internal.h"

const char *ep_backend_name(ep_backend_t backend) {
  switch (backend) {
    case EP_BACKEND_AUTO:
      return "auto";
    case EP_BACKEND_CPU:
      return "cpu";
    case EP_BACKEND_CUDA:
      return "cuda";
  }
  return NULL;
}

/* The ops of a backend built into this library, NULL when it is not. */
static const struct ep_backend_ops *built(ep_backend_t backend) {
  return backend == EP_BACKEND_CPU ? ep_backend_cpu()
         : backend == EP_BACKEND_CUDA ? ep_backend_cuda()
                                      : NULL;
}

int ep_backend_available(ep_backend_t backend) {
  if (backend == EP_BACKEND_AUTO) {
    const char *e = ep_env_str("EP_BACKEND");
    if (e && *e && ep_env_check_value("EP_BACKEND", e) != EP_OK) return 0;
    backend = e && !strcasecmp(e, "cuda") ? EP_BACKEND_CUDA : EP_BACKEND_CPU;
  }
  const char *name = ep_backend_name(backend);
  if (!name) {
    ep_err(EP_ERR_INVALID_ARG, "ep_backend_available: %d is not an ep_backend_t", (int)backend);
    return 0;
  }
  const struct ep_backend_ops *ops = built(backend);
  if (!ops) {
    ep_err(EP_ERR_UNSUPPORTED, "the %s backend is not built into this library", name);
    return 0;
  }
  return !ops->available || ops->available() == EP_OK;
}
