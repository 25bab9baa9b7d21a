/* `epcomm`: launcher, benchmark, doctor, info and demo in one binary. */
#include "epcomm.h"

#include <stdio.h>
#include <string.h>

#include "cli.h"

static int cmd_version(int argc, char **argv);

static const struct {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *help;
} commands[] = {
    {"launch", ep_cmd_launch,
     "launch -n R [--timeout S] [--grace S] [--no-tag] [--] PROGRAM ARGS...\n"
     "                    start R local ranks of PROGRAM; stdin goes to rank 0"},
    {"bench", ep_cmd_bench,
     "bench [--mode normal|ll] [--backend cpu|cuda] [--tokens N] ... [--json [FILE]]\n"
     "                    measure dispatch/combine on either backend (run it under launch)"},
    {"doctor", ep_cmd_doctor,
     "doctor env | run -- CMD | verify -- CMD | classify LOG | rules\n"
     "                    diagnose the communication warnings of any program"},
    {"info", ep_cmd_info, "info                version, backends, EP_* variables and their values"},
    {"demo", ep_cmd_demo,
     "demo [--tokens N] [--hidden H] [--topk K] [--experts E] [--iters I]\n"
     "                    a checked dispatch/combine with its figures (run it under launch)"},
    {"version", cmd_version, "version             the library's version"},
};

static int usage(FILE *f) {
  fprintf(f,
          "epcomm %s — expert-parallel communication\n"
          "usage: epcomm COMMAND [ARGS...]   (epcomm COMMAND --help: its options)\n",
          ep_version_string());
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %s\n", commands[i].help);
  fprintf(f,
          "Two deadlines: `launch --timeout S` limits the whole job's wall-clock time (then\n"
          "its ranks are terminated, exit status 124; default none), EP_TIMEOUT_S each wait\n"
          "inside one epcomm call (the call fails with EP_ERR_TIMEOUT naming the rank it\n"
          "waited for; default 100 s).\n");
  return f == stdout ? 0 : 2;
}

static int cmd_version(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-h") && strcmp(argv[1], "--help")) {
    fprintf(stderr, "epcomm version: unknown argument '%s'\nusage: epcomm version\n", argv[1]);
    return 2;
  }
  printf("epcomm %s\n", ep_version_string());
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) return usage(stderr);
  if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help"))
    return usage(stdout);
  if (!strcmp(argv[1], "--version")) return cmd_version(1, argv);
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "epcomm: unknown command '%s'\n", argv[1]);
  return usage(stderr);
}
