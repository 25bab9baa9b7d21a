/* `epcomm info`: version, the backends and whether each is usable here, and every EP_* variable
 * (the library's registry and the tool's own) with its current value, checked as the library
 * checks it. Uses the public introspection calls of epcomm.h only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

extern char **environ;

static int usage(FILE *f) {
  fprintf(f,
          "usage: epcomm info\n"
          "Prints the library version, the backends built in and whether each is usable on\n"
          "this machine, and every EP_* variable with its default, accepted values and current\n"
          "value. Exit status 1 when a set EP_* variable has a value the library rejects\n"
          "(group and buffer creation would fail with EP_ERR_INVALID_ARG).\n");
  return f == stdout ? 0 : 2;
}

static void print_backends(void) {
  static const ep_backend_t all[] = {EP_BACKEND_CPU, EP_BACKEND_CUDA};
  printf("backends:\n");
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    int ok = ep_backend_available(all[i]);
    printf("  %-5s %s%s\n", ep_backend_name(all[i]),
           ok ? "available" : "not available: ", ok ? "" : ep_last_error());
  }
}

/* One variable: a line of columns, then what it does and what it accepts. Returns 1 when its
 * value is invalid (library rows only: the tool's own are checked by the tool that reads them). */
static int print_var(const ep_env_var_t *v, int library) {
  const char *val = getenv(v->name);
  if (val && !strcmp(v->type, "secret")) val = "(set, not shown)"; /* never print the job key */
  int bad = library && val && ep_env_check_value(v->name, val) != EP_OK;
  printf("%-17s %-6s %-6s %-8s %s%s\n", v->name, v->module, v->type,
         *v->default_value ? v->default_value : "-", val ? val : "(unset)",
         bad ? "   <- INVALID" : "");
  printf("    %s; accepted: %s\n", v->description, v->accepted);
  if (bad) printf("    INVALID: %s\n", ep_last_error());
  return bad;
}

/* Set EP_* names that nobody reads: most likely typos. */
static void print_unknown(void) {
  for (char **e = environ; *e; e++) {
    if (strncmp(*e, "EP_", 3)) continue;
    char name[128];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(*e, "="), *e);
    if (!ep_env_var_find(name) && !cli_env_var_find(name))
      printf(
          "unknown: %s is set, but neither the library nor the epcomm command reads it "
          "(a typo?)\n",
          name);
  }
}

int ep_cmd_info(int argc, char **argv) {
  if (argc > 1) {
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) return usage(stdout);
    fprintf(stderr, "epcomm info: unknown argument '%s'\n", argv[1]);
    return usage(stderr);
  }
  printf("epcomm %s (header %d.%d.%d)\n", ep_version_string(), EP_VERSION_MAJOR, EP_VERSION_MINOR,
         EP_VERSION_PATCH);
  print_backends();
  printf("\nenvironment variables of the library (checked when a group or buffer is created):\n");
  printf("%-17s %-6s %-6s %-8s %s\n", "variable", "module", "type", "default", "value");
  int bad = 0;
  for (int i = 0; i < ep_env_var_count(); i++) bad += print_var(ep_env_var(i), 1);
  printf("\nenvironment variables of the epcomm command:\n");
  for (int i = 0; i < cli_env_var_count(); i++) print_var(cli_env_var(i), 0);
  print_unknown();
  if (bad)
    printf(
        "\n%d invalid value(s): group and buffer creation fail with EP_ERR_INVALID_ARG until "
        "they are fixed or unset\n",
        bad);
  return bad ? 1 : 0;
}
