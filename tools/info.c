/* `epcomm info`: version, backends built in, and every EP_* variable with its current value. */
#include <stdio.h>

#include "cli.h"
#include "core/backend.h"
#include "epcomm.h"

void ep_env_print(FILE *f); /* src/core/env.c */

int ep_cmd_info(int argc, char **argv) {
  (void)argc;
  (void)argv;
  printf("epcomm %s (header %d.%d.%d)\n", ep_version_string(), EP_VERSION_MAJOR, EP_VERSION_MINOR,
         EP_VERSION_PATCH);
  printf("backends: cpu%s\n", ep_backend_cuda() ? ", cuda" : " (cuda not built)");
  printf("\nenvironment:\n");
  ep_env_print(stdout);
  return 0;
}
