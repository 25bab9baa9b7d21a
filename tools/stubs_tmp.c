/* Temporary: subcommands being written on other branches. */
#include <stdio.h>
#include "cli.h"
int ep_cmd_launch(int argc, char **argv) { (void)argc; (void)argv; fprintf(stderr, "launch: not merged yet\n"); return 2; }
int ep_cmd_doctor(int argc, char **argv) { (void)argc; (void)argv; fprintf(stderr, "doctor: not merged yet\n"); return 2; }
