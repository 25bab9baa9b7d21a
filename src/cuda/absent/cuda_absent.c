/* Built instead of the CUDA backend when no CUDA compiler is available. */
#include "core/backend.h"

const struct ep_backend_ops *ep_backend_cuda(void) { return NULL; }
