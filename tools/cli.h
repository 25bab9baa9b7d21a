/* Subcommands of the `epcomm` command-line tool. Each returns the process exit status. */
#ifndef EP_TOOLS_CLI_H
#define EP_TOOLS_CLI_H

int ep_cmd_launch(int argc, char **argv); /* tools/launch.c */
int ep_cmd_bench(int argc, char **argv);  /* tools/bench.c */
int ep_cmd_doctor(int argc, char **argv); /* tools/doctor.c */
int ep_cmd_info(int argc, char **argv);   /* tools/info.c */
int ep_cmd_demo(int argc, char **argv);   /* tools/demo.c */

#endif
