/* A small epcomm program for the doctor's end-to-end test: `leaky leak` does its work and then
 * returns without destroying its buffer and group (the mistake of the seed's test suite);
 * `leaky` does the same work and tears down properly. */
#include <stdio.h>
#include <string.h>

#include "epcomm.h"

int main(int argc, char **argv) {
  ep_group_t g;
  ep_buffer_t b;
  if (ep_group_create_from_env(NULL, &g) || ep_buffer_create(g, NULL, &b)) {
    fprintf(stderr, "leaky: %s\n", ep_last_error());
    return 1;
  }
  if (ep_group_barrier(g)) return 1;
  printf("1 passed, 0 failed\n"); /* what a test runner prints when the work is done */
  fflush(stdout);
  if (argc > 1 && !strcmp(argv[1], "leak")) return 0;
  ep_buffer_destroy(b);
  ep_group_destroy(g);
  return 0;
}
