/* Subcommands of the `epcomm` command-line tool. Each returns the process exit status. */
#ifndef EP_TOOLS_CLI_H
#define EP_TOOLS_CLI_H

#include "epcomm.h"

int ep_cmd_launch(int argc, char **argv); /* tools/launch.c */
int ep_cmd_bench(int argc, char **argv);  /* tools/bench.c */
int ep_cmd_doctor(int argc, char **argv); /* tools/doctor.c */
int ep_cmd_info(int argc, char **argv);   /* tools/info.c */
int ep_cmd_demo(int argc, char **argv);   /* tools/demo.c */

/* EP_* variables read by the tool, not by the library (tools/tool_env.c); the same row type as
 * the library's registry. */
int cli_env_var_count(void);
const ep_env_var_t *cli_env_var(int index);
const ep_env_var_t *cli_env_var_find(const char *name);

#endif
