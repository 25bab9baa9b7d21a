/* Temporary: subcommands being written on other branches. */
#include <stdio.h>
#include "cli.h"
int ep_cmd_bench(int argc, char **argv) { (void)argc; (void)argv; fprintf(stderr, "bench: not written yet\n"); return 2; }
