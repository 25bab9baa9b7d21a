/* The environment registry through the public API (issue 11 item 3), and invalid values of known
 * variables rejected by the call that reads them instead of being replaced by the default (issue
 * 16 item 8). Runs under `epcomm launch -n R`, so that group creation would succeed but for the
 * variable under test. */
#include <string.h>

#include "common.h"

int t_rank = -1;
const char *t_case;

/* The reviewer's examples, and a few more of each kind. */
static const struct {
  const char *name, *value;
} bad[] = {
    {"EP_BACKEND", "gpu"},    {"EP_TIMEOUT_S", "abc"},  {"EP_TIMEOUT_S", "-1"},
    {"EP_TIMEOUT_S", "0"},    {"EP_QUEUE_BYTES", "2X"}, {"EP_QUEUE_BYTES", "1.5M"},
    {"EP_QUEUE_BYTES", "2K"}, {"EP_LOG", "loud"},       {"EP_SPIN_US", "-5"},
    {"EP_CHANNELS", "65"},    {"EP_CUDA_SMS", "many"},  {"EP_LL_WIDE_BYTES", "1MB"},
};
#define NBAD (sizeof bad / sizeof bad[0])

static const struct {
  const char *name, *value;
} good[] = {
    {"EP_QUEUE_BYTES", "2M"}, {"EP_QUEUE_BYTES", "2m"},  {"EP_QUEUE_BYTES", "65536"},
    {"EP_QUEUE_BYTES", "1G"}, {"EP_TIMEOUT_S", "0.5"},   {"EP_LOG", "INFO"},
    {"EP_SPIN_US", "0"},      {"EP_LL_WIDE_BYTES", "0"}, {"EP_BACKEND", "cuda"},
    {"EP_JOB_ID", "x y"},     {"EP_QUEUE_BYTES", ""},
};
#define NGOOD (sizeof good / sizeof good[0])

/* The message names the variable, the value and the accepted form of its row. */
static void check_message(const char *msg, const char *name, const char *value) {
  char nv[128];
  snprintf(nv, sizeof nv, "%s=%s", name, value);
  const ep_env_var_t *v = ep_env_var_find(name);
  T_CHECK(v, "%s not in the registry", name);
  T_CHECK(strstr(msg, nv), "message does not name %s: %s", nv, msg);
  T_CHECK(strstr(msg, v->accepted), "message lacks the accepted form '%s': %s", v->accepted, msg);
}

static void test_registry(void) {
  t_case = "registry";
  int n = ep_env_var_count();
  T_CHECK(n >= 17, "only %d variables", n);
  T_CHECK(!ep_env_var(n) && !ep_env_var(-1), "rows out of range");
  for (int i = 0; i < n; i++) {
    const ep_env_var_t *v = ep_env_var(i);
    T_CHECK(v && !strncmp(v->name, "EP_", 3), "row %d", i);
    T_CHECK(*v->accepted && *v->description && *v->type, "%s: empty fields", v->name);
    T_CHECK(!strcmp(v->module, "core") || !strcmp(v->module, "cpu") || !strcmp(v->module, "cuda") ||
                !strcmp(v->module, "net"),
            "%s: module %s", v->name, v->module);
    T_CHECK(ep_env_var_find(v->name) == v, "%s is not unique", v->name);
    T_OK(ep_env_check_value(v->name, v->default_value)); /* the default is a valid value */
  }
  /* Each part of the library brings its own rows; tool-only variables are not the library's. */
  T_CHECK(!strcmp(ep_env_var_find("EP_SPIN_US")->module, "cpu"), "EP_SPIN_US");
  T_CHECK(!strcmp(ep_env_var_find("EP_CUDA_SMS")->module, "cuda"), "EP_CUDA_SMS");
  T_CHECK(ep_env_var_find("EP_LOCAL_RANK"), "EP_LOCAL_RANK");
  T_CHECK(!ep_env_var_find("EP_DOCTOR_RULES") && !ep_env_var_find("EP_NOPE"), "tool names");
  T_STATUS(EP_ERR_INVALID_ARG, ep_env_check_value("EP_NOPE", "1"));
  T_STATUS(EP_ERR_NULL_ARG, ep_env_check_value(NULL, "1"));
}

static void test_values(void) {
  t_case = "ep_env_check_value";
  for (size_t i = 0; i < NBAD; i++) {
    T_STATUS(EP_ERR_INVALID_ARG, ep_env_check_value(bad[i].name, bad[i].value));
    check_message(ep_last_error(), bad[i].name, bad[i].value);
  }
  for (size_t i = 0; i < NGOOD; i++) T_OK(ep_env_check_value(good[i].name, good[i].value));
}

static int one_rank_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
  (void)ctx;
  memcpy(recv, send, bytes);
  return 0;
}

/* Before: the group came up with the default in place of the bad value. */
static void test_group_create(void) {
  t_case = "group create";
  for (size_t i = 0; i < NBAD; i++) {
    ep_group_t g = NULL;
    setenv(bad[i].name, bad[i].value, 1);
    T_STATUS(EP_ERR_INVALID_ARG, ep_env_check());
    T_STATUS(EP_ERR_INVALID_ARG, ep_group_create_from_env(NULL, &g));
    T_CHECK(!g, "group set on failure");
    const char *m = ep_last_error();
    T_CHECK(!strncmp(m, "ep_group_create_from_env: ", 26), "no call name: %s", m);
    check_message(m, bad[i].name, bad[i].value);
    ep_bootstrap_t boot = {.rank = 0, .nranks = 1, .allgather = one_rank_allgather};
    T_STATUS(EP_ERR_INVALID_ARG, ep_group_create(&boot, NULL, &g));
    check_message(ep_last_error(), bad[i].name, bad[i].value);
    unsetenv(bad[i].name);
  }
  T_OK(ep_env_check());
}

/* Set after the group exists: the buffer, which reads them, refuses. */
static void test_buffer_create(ep_group_t g) {
  t_case = "buffer create";
  static const char *const names[] = {"EP_QUEUE_BYTES", "EP_SPIN_US", "EP_BACKEND", "EP_CHANNELS"};
  static const char *const values[] = {"2X", "-5", "gpu", "0"};
  for (int i = 0; i < 4; i++) {
    ep_buffer_t b = NULL;
    setenv(names[i], values[i], 1);
    T_STATUS(EP_ERR_INVALID_ARG, ep_buffer_create(g, NULL, &b));
    const char *m = ep_last_error();
    T_CHECK(!strncmp(m, "ep_buffer_create: ", 18), "no call name: %s", m);
    check_message(m, names[i], values[i]);
    T_STATUS(EP_ERR_INVALID_ARG, ep_buffer_size_hint(NULL, 2, &(size_t){0}));
    unsetenv(names[i]);
  }
}

/* Before: EP_QUEUE_BYTES=2M gave 1 MiB queues. Now the suffix counts, as in the doctor. */
static void test_size_suffix(ep_group_t g) {
  t_case = "EP_QUEUE_BYTES=2M";
  ep_buffer_config_t two = EP_BUFFER_CONFIG_INIT, one = EP_BUFFER_CONFIG_INIT;
  two.queue_bytes = 2u << 20, one.queue_bytes = 1u << 20;
  size_t want, dflt, got;
  T_OK(ep_buffer_size_hint(&two, 4, &want));
  T_OK(ep_buffer_size_hint(&one, 4, &dflt));
  setenv("EP_QUEUE_BYTES", "2M", 1);
  T_OK(ep_buffer_size_hint(NULL, 4, &got));
  T_CHECK(got == want && got != dflt, "hint %zu, want %zu (1 MiB gives %zu)", got, want, dflt);
  ep_buffer_t b;
  T_OK(ep_buffer_create(g, NULL, &b));
  T_OK(ep_buffer_destroy(b));
  unsetenv("EP_QUEUE_BYTES");
  /* Unset, the registry row's default_value is what the buffer takes (the one place it is
   * written; the code once repeated each default at its read). */
  T_CHECK(!strcmp(ep_env_var_find("EP_QUEUE_BYTES")->default_value, "1M"), "row's default");
  T_OK(ep_buffer_size_hint(NULL, 4, &got));
  T_CHECK(got == dflt, "unset: hint %zu, want the 1 MiB default's %zu", got, dflt);
}

static void test_backends(void) {
  t_case = "backends";
  T_CHECK(!strcmp(ep_backend_name(EP_BACKEND_CPU), "cpu") &&
              !strcmp(ep_backend_name(EP_BACKEND_CUDA), "cuda") &&
              !strcmp(ep_backend_name(EP_BACKEND_AUTO), "auto") && !ep_backend_name(7),
          "names");
  T_CHECK(ep_backend_available(EP_BACKEND_CPU) == 1, "cpu: %s", ep_last_error());
  T_CHECK(ep_backend_available(EP_BACKEND_AUTO) == 1, "auto: %s", ep_last_error());
  T_CHECK(!ep_backend_available((ep_backend_t)7) && strstr(ep_last_error(), "7"), "bad value");
  if (!ep_backend_available(EP_BACKEND_CUDA))
    T_CHECK(strstr(ep_last_error(), "cuda") || strstr(ep_last_error(), "CUDA"), "why not: %s",
            ep_last_error());
  setenv("EP_BACKEND", "gpu", 1);
  T_CHECK(!ep_backend_available(EP_BACKEND_AUTO) && strstr(ep_last_error(), "EP_BACKEND=gpu"),
          "auto with EP_BACKEND=gpu: %s", ep_last_error());
  unsetenv("EP_BACKEND");
}

int main(void) {
  test_registry();
  test_values();
  test_backends();
  test_group_create();
  ep_group_t g;
  T_OK(ep_group_create_from_env(NULL, &g));
  T_OK(ep_group_rank(g, &t_rank));
  test_buffer_create(g);
  test_size_suffix(g);
  T_OK(ep_group_destroy(g));
  return T_PASS;
}
