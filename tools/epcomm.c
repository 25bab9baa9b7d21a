/* `epcomm`: launcher, benchmark, doctor, info and demo in one binary. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "epcomm.h"

static const struct {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *help;
} commands[] = {
    {"launch", ep_cmd_launch, "launch -n R [--timeout S] PROGRAM ARGS...  start R local ranks"},
    {"bench", ep_cmd_bench, "bench [--mode normal|ll] ...              measure dispatch/combine"},
    {"doctor", ep_cmd_doctor, "doctor env | run -- CMD | verify -- CMD   diagnose warnings"},
    {"info", ep_cmd_info, "info                                      version, backends, EP_* variables"},
    {"demo", ep_cmd_demo, "demo                                      dispatch/combine demo (run under launch)"},
};

static int usage(FILE *f) {
  fprintf(f, "epcomm %s — expert-parallel communication\nusage: epcomm COMMAND [ARGS...]\n",
          ep_version_string());
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %s\n", commands[i].help);
  return f == stdout ? 0 : 2;
}

int main(int argc, char **argv) {
  if (argc < 2) return usage(stderr);
  if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help"))
    return usage(stdout);
  if (!strcmp(argv[1], "--version")) {
    printf("epcomm %s\n", ep_version_string());
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "epcomm: unknown command '%s'\n", argv[1]);
  return usage(stderr);
}
