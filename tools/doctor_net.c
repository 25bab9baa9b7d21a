/* `epcomm doctor env`, the part about jobs across hosts: does the job span hosts, can the
 * network engine it needs be loaded, and do the NCCL/MPI variables name what exists here
 * (interfaces, a split of ranks that works). Library loads go through dlopen, as the library's
 * own engines do; nothing here starts MPI or NCCL. */
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "doctor.h"

static const char *env(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

/* The interfaces of this host, as "lo, eth0" (each once). */
static int interfaces(char *out, size_t n) {
  struct ifaddrs *all = NULL;
  out[0] = '\0';
  if (getifaddrs(&all) != 0) return -1;
  size_t used = 0;
  int count = 0;
  for (struct ifaddrs *i = all; i; i = i->ifa_next) {
    if (!i->ifa_name || strstr(out, i->ifa_name)) continue;
    used += (size_t)snprintf(out + used, used < n ? n - used : 0, "%s%s", count ? ", " : "",
                             i->ifa_name);
    count++;
  }
  freeifaddrs(all);
  return count;
}

/* Interfaces that are up and that NCCL_SOCKET_IFNAME lets NCCL use. Its forms: "eth" (names
 * starting so), "=eth0" (exact names), "^docker" / "^=docker0" (all but those); comma-separated. */
static int usable_with(const char *spec, int *excluded_all) {
  struct ifaddrs *all = NULL;
  if (getifaddrs(&all) != 0) return -1;
  bool exclude = spec[0] == '^';
  if (exclude) spec++;
  bool exact = spec[0] == '=';
  if (exact) spec++;
  char list[256];
  snprintf(list, sizeof list, "%s", spec);
  int hits = 0, total = 0;
  for (struct ifaddrs *i = all; i; i = i->ifa_next) {
    if (!i->ifa_name || !(i->ifa_flags & IFF_UP)) continue;
    total++;
    bool hit = false;
    char tmp[256], *save = NULL;
    snprintf(tmp, sizeof tmp, "%s", list);
    for (char *e = strtok_r(tmp, ",", &save); e && !hit; e = strtok_r(NULL, ",", &save))
      hit = exact ? !strcmp(e, i->ifa_name) : !strncmp(i->ifa_name, e, strlen(e));
    hits += exclude ? !hit : hit;
  }
  freeifaddrs(all);
  *excluded_all = exclude && hits == 0 && total > 0;
  return hits;
}

/* NCCL_SOCKET_IFNAME must leave at least one interface that is up, or NCCL's bootstrap fails at
 * communicator creation ("no socket interface found"). */
int dr_judge_socket_ifname(const char *v, const char **fix) {
  static char msg[320];
  int excluded = 0, hits = usable_with(v, &excluded);
  if (hits != 0) {
    *fix = "";
    return DR_INFO;
  }
  char names[200];
  interfaces(names, sizeof names);
  snprintf(msg, sizeof msg,
           "it %s no interface that is up here (interfaces: %s): NCCL then "
           "fails to create communicators; name one of them (NCCL_SOCKET_IFNAME=lo on one machine)",
           excluded ? "excludes every" : "matches", names);
  *fix = msg;
  return DR_FAIL;
}

/* InfiniBand/RoCE devices of this host (/sys/class/infiniband), 0 when none or unknown. */
static int ib_devices(void) {
  DIR *d = opendir("/sys/class/infiniband");
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));) n += e->d_name[0] != '.';
  if (d) closedir(d);
  return n;
}

/* NCCL_IB_DISABLE=1 where this host has InfiniBand/RoCE devices: NCCL crosses hosts over TCP
 * sockets, a fraction of the NICs' bandwidth (right only for pretend hosts on one machine). */
int dr_judge_ib_disable(const char *v, const char **fix) {
  static char msg[256];
  int n = ib_devices();
  bool off = !strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes");
  if (!off || n == 0) {
    *fix = "";
    return DR_INFO;
  }
  snprintf(msg, sizeof msg,
           "this host has %d InfiniBand/RoCE device(s) (/sys/class/infiniband): unset it, or NCCL "
           "crosses hosts over TCP sockets (keep it only for pretend hosts on one machine)",
           n);
  *fix = msg;
  return DR_WARN;
}

/* Does an entry of Open MPI's interface lists (a name, or an IPv4 subnet a.b.c.d/n) name
 * something here? Names: exact, any state (Open MPI skips interfaces that are down itself). */
static bool ompi_iface_exists(const struct ifaddrs *all, const char *e) {
  const char *slash = strchr(e, '/');
  if (!slash) {
    for (const struct ifaddrs *i = all; i; i = i->ifa_next)
      if (i->ifa_name && !strcmp(i->ifa_name, e)) return true;
    return false;
  }
  char net[64];
  snprintf(net, sizeof net, "%.*s", (int)(slash - e), e);
  struct in_addr a;
  int bits = atoi(slash + 1);
  if (inet_pton(AF_INET, net, &a) != 1 || bits < 0 || bits > 32) return false;
  uint32_t mask = bits ? htonl(~0u << (32 - bits)) : 0;
  for (const struct ifaddrs *i = all; i; i = i->ifa_next)
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
        (((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr.s_addr & mask) ==
            (a.s_addr & mask))
      return true;
  return false;
}

/* Entries of `list` that name nothing here, comma-separated into `missing`; how many of all. */
static int ompi_missing(const char *list, char *missing, size_t n, int *total) {
  struct ifaddrs *all = NULL;
  missing[0] = '\0';
  *total = 0;
  if (getifaddrs(&all) != 0) return 0;
  char tmp[512], *save = NULL;
  snprintf(tmp, sizeof tmp, "%s", list);
  int count = 0;
  size_t used = 0;
  for (char *e = strtok_r(tmp, ",", &save); e; e = strtok_r(NULL, ",", &save)) {
    while (*e == ' ') e++;
    if (!*e) continue;
    ++*total;
    if (ompi_iface_exists(all, e)) continue;
    used += (size_t)snprintf(missing + used, used < n ? n - used : 0, "%s%s", count ? ", " : "", e);
    count++;
  }
  freeifaddrs(all);
  return count;
}

/* Open MPI's own variables that break a job across hosts before epcomm runs: interface lists
 * naming what does not exist here (its TCP transport, or mpirun's out-of-band channel, then has
 * nothing to connect over: MPI_Init fails or hangs), both an include and an exclude list (Open
 * MPI refuses that), a BTL list without "self". */
static void check_ompi(dr_checks_t *c) {
  static const char *const lists[][2] = {
      {"OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude"},
      {"OMPI_MCA_oob_tcp_if_include", "OMPI_MCA_oob_tcp_if_exclude"},
  };
  char names[200], missing[256];
  interfaces(names, sizeof names);
  for (size_t k = 0; k < sizeof lists / sizeof lists[0]; k++) {
    const char *inc = env(lists[k][0]), *exc = env(lists[k][1]);
    if (inc && exc)
      dr_check_add(c, lists[k][0], DR_FAIL, "set only one of the two",
                   "and %s are both set: Open MPI refuses to start (include and exclude lists)",
                   lists[k][1]);
    if (!inc) continue;
    int total, n = ompi_missing(inc, missing, sizeof missing, &total);
    bool btl = k == 0;
    if (n == 0)
      dr_check_add(c, lists[k][0], DR_OK, "", "=%s: every entry names an interface here", inc);
    else
      dr_check_add(c, lists[k][0], n == total ? DR_FAIL : DR_WARN,
                   "name interfaces (or a.b.c.d/n subnets) that exist on every host; here: see "
                   "`ip addr` (the same names on every host, or use a subnet)",
                   "=%s: %s not here (interfaces: %s): %s", inc, missing, names,
                   n < total ? "those entries are ignored"
                   : btl     ? "the MPI engine's TCP transport has no interface: ranks on "
                               "other hosts cannot be reached"
                         : "mpirun cannot reach its daemons: the job fails or hangs at startup");
  }
  const char *btl = env("OMPI_MCA_btl");
  if (btl && btl[0] != '^' && !strstr(btl, "self"))
    dr_check_add(c, "OMPI_MCA_btl", DR_FAIL, "add self: OMPI_MCA_btl=self,vader,tcp",
                 "=%s: without \"self\" a rank cannot send to itself; MPI_Init fails", btl);
  else if (btl && btl[0] != '^' && !strstr(btl, "tcp") && !strstr(btl, "openib") &&
           !strstr(btl, "ofi") && env("OMPI_COMM_WORLD_LOCAL_SIZE") &&
           env("OMPI_COMM_WORLD_SIZE") &&
           strcmp(env("OMPI_COMM_WORLD_LOCAL_SIZE"), env("OMPI_COMM_WORLD_SIZE")))
    dr_check_add(c, "OMPI_MCA_btl", DR_WARN, "add tcp (or your network's BTL): self,vader,tcp",
                 "=%s: this job spans machines but no BTL here crosses them", btl);
}

/* What this job's environment says about hosts. */
static void check_split(dr_checks_t *c) {
  const char *hosts = env("EP_HOSTS"), *id = env("EP_HOST_ID");
  const char *size = env("OMPI_COMM_WORLD_SIZE"), *local = env("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!size) size = env("EP_NRANKS");
  int H = hosts ? atoi(hosts) : 1, R = size ? atoi(size) : 0;
  bool mpi = env("OMPI_COMM_WORLD_SIZE") || env("PMIX_RANK") || env("PMI_SIZE");
  if (H > 1 && R > 0 && R % H)
    dr_check_add(c, "hosts", DR_FAIL, "make EP_HOSTS divide the number of ranks",
                 "EP_HOSTS=%d does not divide the %d ranks: every host holds as many ranks", H, R);
  else if ((H > 1 || id) && !mpi)
    dr_check_add(c, "hosts", DR_WARN,
                 "start the ranks with `epcomm launch -n R --hosts H` or "
                 "mpirun: the hosts talk through MPI",
                 "%s set, but not under an MPI launcher", id ? "EP_HOST_ID" : "EP_HOSTS");
  else if (H > 1 || id)
    dr_check_add(c, "hosts", DR_OK, "",
                 "the job is split into hosts (%s); between them the "
                 "network engine: MPI (cpu buffers), NCCL (cuda)",
                 id ? "EP_HOST_ID" : hosts);
  else if (local && size && strcmp(local, size))
    dr_check_add(c, "hosts", DR_OK, "",
                 "this mpirun job spans machines (%s of %s ranks here): "
                 "groups span hosts through MPI",
                 local, size);
  else
    dr_check_add(c, "hosts", DR_INFO, "", "one host: no network engine is loaded");
}

/* The MPI engine needs Open MPI's ABI (libmpi.so.40) and, for pretend hosts, mpirun. */
static void check_mpi_engine(dr_checks_t *c) {
  const char *forced = env("EP_MPI_LIB");
  void *h = dlopen(forced ? forced : "libmpi.so.40", RTLD_LAZY | RTLD_LOCAL);
  bool ompi = h && dlsym(h, "ompi_mpi_comm_world");
  if (!h)
    dr_check_add(c, "engine mpi", DR_INFO,
                 "install Open MPI (libopenmpi3 / openmpi-bin) on every "
                 "host for cpu jobs across hosts",
                 "%s cannot be loaded: cpu groups stay on one host",
                 forced ? forced : "libmpi.so.40");
  else if (!ompi)
    dr_check_add(c, "engine mpi", DR_FAIL, "point EP_MPI_LIB at an Open MPI libmpi.so.40",
                 "%s is not Open MPI (the MPI engine uses its ABI)",
                 forced ? forced : "libmpi.so.40");
  else
    dr_check_add(c, "engine mpi", DR_OK, "", "Open MPI loadable: cpu groups can span hosts");
  bool mpirun = false;
  const char *path = env("PATH");
  char buf[4096];
  for (const char *p = path; p && *p && !mpirun;) {
    const char *end = strchr(p, ':');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    snprintf(buf, sizeof buf, "%.*s/mpirun", (int)len, p);
    mpirun = len && access(buf, X_OK) == 0;
    p = end ? end + 1 : NULL;
  }
  dr_check_add(c, "mpirun", mpirun ? DR_OK : DR_INFO,
               mpirun ? "" : "`epcomm launch --hosts` needs mpirun (openmpi-bin)",
               mpirun ? "on PATH (epcomm launch --hosts runs it)" : "not on PATH");
}

static void check_nccl_engine(dr_checks_t *c) {
  const char *ifname = env("NCCL_SOCKET_IFNAME"), *hostid = env("NCCL_HOSTID");
  if (!ifname && hostid)
    dr_check_add(c, "NCCL_SOCKET_IFNAME", DR_WARN,
                 "set NCCL_SOCKET_IFNAME=lo for pretend hosts "
                 "on one machine",
                 "unset with NCCL_HOSTID: NCCL may pick an interface the "
                 "ranks cannot reach each other on");
  if (hostid && !env("NCCL_IB_DISABLE"))
    dr_check_add(c, "NCCL_IB_DISABLE", DR_INFO,
                 "set NCCL_IB_DISABLE=1 for pretend hosts on one "
                 "machine",
                 "unset with NCCL_HOSTID");
}

void dr_net_run(dr_checks_t *c) {
  check_split(c);
  check_mpi_engine(c);
  check_ompi(c);
  check_nccl_engine(c);
}
