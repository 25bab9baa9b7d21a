/* What identifies a job in the environment: the id its ranks meet under (the rendezvous name
 * is "<id>.<n>") and the key they prove to each other when they connect (bootstrap.h).
 *
 * The id must differ between any two jobs that can run on one host at once. EP_JOB_ID (set by
 * `epcomm launch`, or by hand) wins; else the launcher's own job identity: OpenMPI's job id,
 * the PMIx namespace, or SLURM's job id *and* step id (the step id alone is 0 for every job's
 * first step). The key comes from EP_JOB_SECRET (random per job under `epcomm launch`); without
 * it, from the same job identity, which every rank shares. Either way a collision of ids that
 * is left (two jobs given the same EP_JOB_ID, say) meets a different key and is refused. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "group.h"

/* A launcher's job identity: the variables that together name one of its jobs; the first one
 * is required. Job-wide values only (every rank of the job sees the same). */
static const struct {
  const char *prefix;
  const char *vars[3];
} sources[] = {
    {"ompi", {"OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_hnp_uri", NULL}},
    {"pmix", {"PMIX_NAMESPACE", NULL, NULL}},
    {"slurm", {"SLURM_JOB_ID", "SLURM_STEP_ID", NULL}},
};

static const char *var(const char *name) {
  const char *s = getenv(name);
  return s && *s ? s : NULL;
}

/* Characters that are safe in logs and socket names; others become '_'. */
static void sanitize(char *s) {
  for (; *s; s++)
    if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@:+-", *s))
      *s = '_';
}

static void hash_vars(ep_sha256_t *h, int src) {
  for (int v = 0; v < 3 && sources[src].vars[v]; v++) {
    const char *val = var(sources[src].vars[v]);
    ep_sha256_update(h, sources[src].vars[v], strlen(sources[src].vars[v]) + 1);
    if (val) ep_sha256_update(h, val, strlen(val) + 1);
  }
}

/* "slurm-1001.0", "ompi-2847277057", "pmix-prterun-host-1234@1"; a long one is cut and gets a
 * hash of the whole so that it stays unique. */
static void source_id(int src, char *id, size_t n) {
  const char *a = var(sources[src].vars[0]);
  const char *b = src == 2 ? var(sources[src].vars[1]) : NULL;
  char full[256];
  snprintf(full, sizeof full, "%s-%s%s%s", sources[src].prefix, a, src == 2 ? "." : "",
           src == 2 ? (b ? b : "none") : "");
  sanitize(full);
  if (strlen(full) < n && strlen(full) <= 48) {
    snprintf(id, n, "%s", full);
    return;
  }
  ep_sha256_t h;
  uint8_t d[32];
  ep_sha256_init(&h);
  hash_vars(&h, src);
  ep_sha256_final(&h, d);
  snprintf(id, n, "%.32s-%02x%02x%02x%02x%02x%02x", full, d[0], d[1], d[2], d[3], d[4], d[5]);
}

static int find_source(void) {
  for (int s = 0; s < (int)(sizeof sources / sizeof sources[0]); s++)
    if (var(sources[s].vars[0])) return s;
  return -1;
}

/* Without EP_JOB_SECRET: what all ranks share about the job. It keeps apart jobs whose ids
 * collide but whose launchers differ; it is no secret from other processes of the same user. */
static void derived_key(const char *id, int src, uint8_t key[EP_KEY_BYTES]) {
  static const char domain[] = "epcomm derived job secret v1";
  ep_sha256_t h;
  ep_sha256_init(&h);
  ep_sha256_update(&h, domain, sizeof domain);
  ep_sha256_update(&h, id, strlen(id) + 1);
  if (src >= 0) hash_vars(&h, src);
  ep_sha256_final(&h, key);
  char hex[2 * EP_KEY_BYTES + 1];
  for (int i = 0; i < EP_KEY_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", key[i]);
  ep_secret_key(hex, key);
}

ep_status_t ep_job_from_env(const char *cfg_job, char *id, size_t n, uint8_t key[EP_KEY_BYTES]) {
  const char *given = cfg_job ? cfg_job : ep_env_str("EP_JOB_ID");
  int src = given && *given ? -1 : find_source();
  if (given && *given)
    snprintf(id, n, "%.60s", given);
  else if (src >= 0)
    source_id(src, id, n);
  else
    return ep_err(EP_ERR_BOOTSTRAP,
                  "ep_group_create_from_env: no job id (EP_JOB_ID, "
                  "torchrun's MASTER_ADDR and MASTER_PORT, or mpirun's / srun's job variables) "
                  "to meet the other ranks under");
  const char *secret = ep_env_str("EP_JOB_SECRET");
  if (secret && *secret)
    ep_secret_key(secret, key);
  else
    derived_key(id, src >= 0 ? src : find_source(), key);
  return EP_OK;
}
