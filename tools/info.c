/* `epcomm info`: version, backends built in, and every EP_* variable with its current value. */
#include <stdio.h>

#include "cli.h"
#include "epcomm.h"

void ep_env_print(FILE *f); /* src/core/env.c */

int ep_cmd_info(int argc, char **argv) {
  (void)argc;
  (void)argv;
  printf("epcomm %s (header %d.%d.%d)\n", ep_version_string(), EP_VERSION_MAJOR, EP_VERSION_MINOR,
         EP_VERSION_PATCH);
  printf("backends:");
  static const ep_backend_t all[] = {EP_BACKEND_CPU, EP_BACKEND_CUDA};
  static const char *names[] = {"cpu", "cuda"};
  for (int i = 0; i < 2; i++) {
    if (ep_backend_available(all[i])) printf(" %s", names[i]);
    else printf(" %s (%s)", names[i], ep_last_error());
  }
  printf("\n");
  printf("\nenvironment:\n");
  ep_env_print(stdout);
  return 0;
}
