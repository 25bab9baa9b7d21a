/* The EP_* variables of the `epcomm` command itself. The library's variables are in its own
 * registry (ep_env_var and friends in epcomm.h); `epcomm info` and `epcomm doctor env` show both.
 */
#include <string.h>

#include "cli.h"

static const ep_env_var_t tool_rows[] = {
    {"EP_DOCTOR_RULES", "doctor", "path", "", "a readable rulebook file",
     "rulebook of epcomm doctor (default: share/doctor-rules.txt of the source or install "
     "tree); not passed on to the commands the doctor runs"},
    {"EP_BENCH_LL_FILL", "bench", "enum", "", "copies",
     "epcomm bench --mode ll --backend cuda: the expert outputs put into the zero-copy rows by "
     "one cudaMemcpyAsync per expert (copies) instead of one kernel"},
    {"EP_BENCH_REFUSE", "bench", "string", "", "RANK:TEXT",
     "for tests: rank RANK of epcomm bench is not ready at every agreement whose name contains "
     "TEXT, so that every rank stops (docs/PERFORMANCE.md)"},
};

int cli_env_var_count(void) {
  return (int)(sizeof tool_rows / sizeof tool_rows[0]);
}

const ep_env_var_t *cli_env_var(int index) {
  return index >= 0 && index < cli_env_var_count() ? &tool_rows[index] : NULL;
}

const ep_env_var_t *cli_env_var_find(const char *name) {
  for (int i = 0; i < cli_env_var_count(); i++)
    if (!strcmp(tool_rows[i].name, name)) return &tool_rows[i];
  return NULL;
}
