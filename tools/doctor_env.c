/* `epcomm doctor env`: the seed's step 2 ("check the environment") as a table of checks.
 *
 * Everything vendor-specific is reached through dlopen, never linked: the doctor must run on a
 * machine with no GPU, no driver, no NCCL and no MPI, and say so rather than fail to start. */
#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "cli.h"
#include "doctor.h"

extern char **environ;

#define MIB (1024.0 * 1024.0)
#define GIB (1024.0 * MIB)

const char *dr_status_name(int status) {
  static const char *names[] = {"OK", "WARN", "FAIL", "INFO"};
  return status >= 0 && status <= DR_INFO ? names[status] : "?";
}

void dr_check_add(dr_checks_t *c, const char *check, int status, const char *fix,
                  const char *detail_fmt, ...) {
  if (c->n == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 32;
    dr_check_t *v = realloc(c->v, cap * sizeof *v);
    if (!v) return;
    c->v = v;
    c->cap = cap;
  }
  dr_check_t *k = &c->v[c->n++];
  snprintf(k->check, sizeof k->check, "%s", check);
  k->status = status;
  snprintf(k->fix, sizeof k->fix, "%s", fix ? fix : "");
  va_list ap;
  va_start(ap, detail_fmt);
  vsnprintf(k->detail, sizeof k->detail, detail_fmt, ap);
  va_end(ap);
}

/* Opens the first library of a NULL-terminated list. The handle is never closed: some of these
 * libraries (MPI, NCCL) do not survive dlclose, and the process ends soon anyway. */
static void *open_first(const char *const *names, char *path, size_t len) {
  for (; *names; names++) {
    void *h = dlopen(*names, RTLD_LAZY | RTLD_LOCAL);
    if (!h) continue;
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name[0])
      snprintf(path, len, "%s", lm->l_name);
    else
      snprintf(path, len, "%s", *names);
    return h;
  }
  return NULL;
}

/* ---- GPUs through the driver API ------------------------------------------------------------- */

typedef int cu_result_t; /* CUresult; 0 is CUDA_SUCCESS */

typedef struct {
  void *h;
  cu_result_t (*init)(unsigned);
  cu_result_t (*driver_version)(int *);
  cu_result_t (*count)(int *);
  cu_result_t (*get)(int *, int);
  cu_result_t (*name)(char *, int, int);
  cu_result_t (*mem)(size_t *, int);
  cu_result_t (*attr)(int *, int, int);
  cu_result_t (*pci)(char *, int, int);
  cu_result_t (*can_peer)(int *, int, int);
  cu_result_t (*err_name)(cu_result_t, const char **);
} cuda_t;

typedef struct {
  void *h;
  int (*init)(void);
  int (*by_pci)(const char *, void **);
  int (*p2p)(void *, void *, int, int *);
  int (*ancestor)(void *, void *, int *);
} nvml_t;

typedef struct {
  int ngpu;     /* -1: no driver, or no device */
  int have_lib; /* libnccl could be opened */
  char bus[16][32];
} env_state_t;

#define SYM(api, field, name) (*(void **)&(api)->field = dlsym((api)->h, name))

static const char *cu_err(const cuda_t *cu, cu_result_t rc) {
  const char *s = NULL;
  if (cu->err_name && cu->err_name(rc, &s) == 0 && s) return s;
  return "unknown CUresult";
}

static int cuda_open(cuda_t *cu, char *path, size_t len) {
  static const char *const names[] = {"libcuda.so.1", "libcuda.so", NULL};
  memset(cu, 0, sizeof *cu);
  if (!(cu->h = open_first(names, path, len))) return -1;
  SYM(cu, init, "cuInit"), SYM(cu, driver_version, "cuDriverGetVersion");
  SYM(cu, count, "cuDeviceGetCount"), SYM(cu, get, "cuDeviceGet");
  SYM(cu, name, "cuDeviceGetName"), SYM(cu, mem, "cuDeviceTotalMem_v2");
  SYM(cu, attr, "cuDeviceGetAttribute"), SYM(cu, pci, "cuDeviceGetPCIBusId");
  SYM(cu, can_peer, "cuDeviceCanAccessPeer"), SYM(cu, err_name, "cuGetErrorName");
  return cu->init && cu->driver_version && cu->count && cu->get && cu->name ? 0 : -1;
}

static void gpu_detail(const cuda_t *cu, int dev, env_state_t *st, char *out, size_t len) {
  char name[128] = "?";
  size_t mem = 0;
  int major = 0, minor = 0;
  cu->name(name, sizeof name, dev);
  if (cu->mem) cu->mem(&mem, dev);
  if (cu->attr) cu->attr(&major, 75, dev), cu->attr(&minor, 76, dev); /* compute capability */
  if (cu->pci && dev < 16) cu->pci(st->bus[dev], sizeof st->bus[dev], dev);
  snprintf(out, len, "%s, %.1f GiB, sm_%d%d, bus %s", name, (double)mem / GIB, major, minor,
           dev < 16 ? st->bus[dev] : "?");
}

static void check_gpus(dr_checks_t *c, cuda_t *cu, env_state_t *st) {
  char path[512] = "";
  st->ngpu = -1;
  if (cuda_open(cu, path, sizeof path)) {
    dr_check_add(c, "gpu", DR_INFO,
                 "nothing to do for the cpu backend; the cuda backend needs the NVIDIA driver",
                 "no GPU / no CUDA driver: libcuda.so.1 not found on the loader path");
    return;
  }
  int ver = 0, n = 0;
  cu->driver_version(&ver);
  cu_result_t rc = cu->init(0);
  if (rc == 0) rc = cu->count(&n);
  if (rc != 0 || n == 0) {
    dr_check_add(c, "gpu", DR_INFO, "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and /dev/nvidia*",
                 "CUDA driver %d.%d (%s) but no usable GPU: cuInit -> %d %s", ver / 1000,
                 ver % 1000 / 10, path, rc, rc ? cu_err(cu, rc) : "(0 devices)");
    return;
  }
  st->ngpu = n;
  dr_check_add(c, "cuda driver", DR_OK, "", "CUDA driver API %d.%d, %d GPU(s), %s", ver / 1000,
               ver % 1000 / 10, n, path);
  for (int i = 0; i < n; i++) {
    char label[32], detail[256];
    int dev = 0;
    cu->get(&dev, i);
    gpu_detail(cu, dev, st, detail, sizeof detail);
    snprintf(label, sizeof label, "gpu %d", i);
    dr_check_add(c, label, DR_OK, "", "%s", detail);
  }
}

static int nvml_open(nvml_t *nv) {
  static const char *const names[] = {"libnvidia-ml.so.1", NULL};
  char path[512];
  memset(nv, 0, sizeof *nv);
  if (!(nv->h = open_first(names, path, sizeof path))) return -1;
  SYM(nv, init, "nvmlInit_v2"), SYM(nv, by_pci, "nvmlDeviceGetHandleByPciBusId_v2");
  SYM(nv, p2p, "nvmlDeviceGetP2PStatus"), SYM(nv, ancestor, "nvmlDeviceGetTopologyCommonAncestor");
  return nv->init && nv->by_pci && nv->init() == 0 ? 0 : -1;
}

/* Link type in nvidia-smi's words. CUDA ordinals and NVML indices may differ (CUDA_DEVICE_ORDER,
 * CUDA_VISIBLE_DEVICES), so devices are matched by PCI bus id. */
static const char *link_type(nvml_t *nv, const env_state_t *st, int a, int b) {
  void *da = NULL, *db = NULL;
  int s = -1, level = -1;
  if (!nv->h || a >= 16 || b >= 16) return "link type unknown (no NVML)";
  if (nv->by_pci(st->bus[a], &da) || nv->by_pci(st->bus[b], &db)) return "link type unknown";
  if (nv->p2p && nv->p2p(da, db, 2 /* NVML_P2P_CAPS_INDEX_NVLINK */, &s) == 0 && s == 0)
    return "NVLink";
  if (!nv->ancestor || nv->ancestor(da, db, &level)) return "PCIe (level unknown)";
  switch (level) {
    case 0:
      return "same board";
    case 10:
      return "PCIe, one switch (PIX)";
    case 20:
      return "PCIe, several switches (PXB)";
    case 30:
      return "PCIe host bridge (PHB)";
    case 40:
      return "PCIe across host bridges, same NUMA node (NODE)";
    default:
      return "across NUMA nodes (SYS)";
  }
}

static void check_peers(dr_checks_t *c, cuda_t *cu, const env_state_t *st) {
  if (st->ngpu < 2) {
    dr_check_add(c, "peer access", DR_INFO, "", "%s",
                 st->ngpu < 0 ? "no GPU: nothing to check" : "one GPU: no GPU pair to check");
    return;
  }
  nvml_t nv;
  int have_nvml = nvml_open(&nv) == 0;
  if (!have_nvml) nv.h = NULL;
  for (int a = 0; a < st->ngpu; a++)
    for (int b = a + 1; b < st->ngpu; b++) {
      int ab = 0, ba = 0, da = 0, db = 0;
      cu->get(&da, a), cu->get(&db, b);
      if (cu->can_peer) cu->can_peer(&ab, da, db), cu->can_peer(&ba, db, da);
      char label[40];
      snprintf(label, sizeof label, "peer %d<->%d", a, b);
      int ok = ab && ba;
      dr_check_add(c, label, ok ? DR_OK : DR_WARN,
                   ok ? ""
                      : "intranode traffic between these GPUs goes through host memory; "
                        "check IOMMU/ACS settings, or place ranks on peer-capable GPUs",
                   "peer access %s, %s",
                   ok         ? "yes"
                   : ab || ba ? "one direction only"
                              : "no",
                   link_type(&nv, st, a, b));
    }
}

/* ---- libraries that would be loaded ---------------------------------------------------------- */

static void check_cudart(dr_checks_t *c, const cuda_t *cu, const env_state_t *st) {
  static const char *const names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12",
                                      "libcudart.so.11.0", NULL};
  char path[512];
  void *h = open_first(names, path, sizeof path);
  int (*rt_version)(int *) = h ? (int (*)(int *))dlsym(h, "cudaRuntimeGetVersion") : NULL;
  int rt = 0, drv = 0;
  if (!rt_version || rt_version(&rt) != 0) {
    dr_check_add(c, "libcudart", DR_INFO, "only needed to build or run CUDA code",
                 "CUDA runtime not found on the loader path");
    return;
  }
  if (cu->h && cu->driver_version) cu->driver_version(&drv);
  int too_new = cu->h && st->ngpu > 0 && rt / 1000 > drv / 1000;
  dr_check_add(
      c, "libcudart", too_new ? DR_FAIL : DR_OK,
      too_new ? "install a driver for this CUDA major version, or use a matching runtime" : "",
      "CUDA runtime %d.%d, %s%s", rt / 1000, rt % 1000 / 10, path,
      too_new ? " (newer than the driver: cudaErrorInsufficientDriver)" : "");
}

static void check_nccl(dr_checks_t *c, env_state_t *st) {
  static const char *const names[] = {"libnccl.so.2", "libnccl.so", NULL};
  char path[512];
  void *h = open_first(names, path, sizeof path);
  int (*get_version)(int *) = h ? (int (*)(int *))dlsym(h, "ncclGetVersion") : NULL;
  int v = 0;
  if (!get_version || get_version(&v) != 0) {
    dr_check_add(c, "libnccl", DR_INFO,
                 "none for single-host epcomm jobs; a PyTorch wheel loads its own libnccl by rpath "
                 "(add its nvidia/nccl/lib to LD_LIBRARY_PATH to check that one)",
                 "NCCL not found on the loader path");
    return;
  }
  st->have_lib = 1;
  int major = v >= 10000 ? v / 10000 : v / 1000,
      minor = v >= 10000 ? v % 10000 / 100 : v % 1000 / 100;
  dr_check_add(c, "libnccl", DR_OK, "", "NCCL %d.%d.%d, %s", major, minor, v % 100, path);
}

/* MPI_Get_library_version is one of the few MPI calls allowed before MPI_Init, so the version
 * is read without starting MPI. */
static void check_mpi(dr_checks_t *c) {
  static const char *const names[] = {"libmpi.so.40", "libmpi.so.12", "libmpi.so", NULL};
  char path[512], ver[8192] = "";
  void *h = open_first(names, path, sizeof path);
  int (*lib_version)(char *, int *) =
      h ? (int (*)(char *, int *))dlsym(h, "MPI_Get_library_version") : NULL;
  int len = 0;
  if (!lib_version || lib_version(ver, &len) != 0) {
    dr_check_add(c, "libmpi", DR_INFO, "only needed for multi-host cpu jobs and the MPI baseline",
                 "MPI not found on the loader path");
    return;
  }
  ver[strcspn(ver, "\n,")] = '\0';
  dr_check_add(c, "libmpi", DR_OK, "", "%s, %s", ver, path);
}

static void check_nvshmem(dr_checks_t *c) {
  static const char *const names[] = {"libnvshmem_host.so.3", "libnvshmem_host.so", NULL};
  char path[512];
  void *h = open_first(names, path, sizeof path);
  if (!h) {
    dr_check_add(c, "libnvshmem", DR_INFO, "epcomm does not need NVSHMEM",
                 "NVSHMEM host library not found on the loader path");
    return;
  }
  void (*get_version)(int *, int *) = (void (*)(int *, int *))dlsym(h, "nvshmem_info_get_version");
  int major = 0, minor = 0;
  if (get_version) get_version(&major, &minor);
  dr_check_add(c, "libnvshmem", DR_OK, "", "NVSHMEM %d.%d, %s", major, minor, path);
}

/* ---- MPS, shared memory, limits -------------------------------------------------------------- */

/* pid of a running nvidia-cuda-mps-control, found by the first word of each /proc/PID/cmdline. */
static long find_mps_daemon(void) {
  DIR *d = opendir("/proc");
  struct dirent *e;
  long found = 0;
  while (d && !found && (e = readdir(d))) {
    char p[288], cmd[256] = "";
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    snprintf(p, sizeof p, "/proc/%s/cmdline", e->d_name);
    FILE *f = fopen(p, "r");
    if (!f) continue;
    size_t n = fread(cmd, 1, sizeof cmd - 1, f);
    fclose(f);
    cmd[n] = '\0';
    const char *base = strrchr(cmd, '/');
    if (!strcmp(base ? base + 1 : cmd, "nvidia-cuda-mps-control")) found = atol(e->d_name);
  }
  if (d) closedir(d);
  return found;
}

static void check_mps(dr_checks_t *c, const env_state_t *st) {
  const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
  char pipe[512];
  snprintf(pipe, sizeof pipe, "%s/control", dir && *dir ? dir : "/tmp/nvidia-mps");
  long pid = find_mps_daemon();
  int has_pipe = access(pipe, F_OK) == 0;
  if (pid) {
    dr_check_add(c, "mps", has_pipe ? DR_OK : DR_WARN,
                 has_pipe ? "" : "set CUDA_MPS_PIPE_DIRECTORY to the daemon's pipe directory",
                 "MPS control daemon running (pid %ld); %s %s", pid, pipe,
                 has_pipe ? "exists" : "missing: clients here will not find the daemon");
  } else if (has_pipe) {
    dr_check_add(c, "mps", DR_WARN, "remove the stale pipe directory or restart the daemon",
                 "%s exists but no nvidia-cuda-mps-control runs", pipe);
  } else {
    dr_check_add(
        c, "mps", DR_INFO,
        st->ngpu > 0 ? "for several ranks on one GPU start it: nvidia-cuda-mps-control -d" : "",
        "MPS daemon not running%s",
        st->ngpu > 0 ? ": processes sharing a GPU time-slice" : " (no GPU)");
  }
}

/* NCCL's shared-memory transport and PyTorch's multiprocessing put their files in /dev/shm:
 * Docker's default of 64 MiB is a classic cause of NCCL failures. epcomm does not use it. */
static void check_devshm(dr_checks_t *c) {
  struct statvfs sv;
  if (statvfs("/dev/shm", &sv) != 0) {
    dr_check_add(c, "/dev/shm", DR_WARN,
                 "NCCL and PyTorch need it: mount -t tmpfs -o size=8g tmpfs /dev/shm",
                 "/dev/shm is missing: %m (epcomm does not use it)");
    return;
  }
  double total = (double)sv.f_blocks * sv.f_frsize, avail = (double)sv.f_bavail * sv.f_frsize;
  int small = total <= 64 * MIB;
  dr_check_add(c, "/dev/shm", small ? DR_WARN : DR_OK,
               small ? "NCCL's shm transport and PyTorch need more: docker run --shm-size=8g, or "
                       "mount -o remount,size=8g /dev/shm"
                     : "",
               "%.1f GiB free of %.1f GiB%s; used by NCCL and PyTorch, not by epcomm (its "
               "segments are memfds)",
               avail / GIB, total / GIB, small ? " (64 MiB: Docker's default)" : "");
}

/* A number from a one-line file; -1 when absent, "max" (cgroup v2: no limit) gives INFINITY. */
static double read_number(const char *path) {
  FILE *f = fopen(path, "re");
  char b[64] = "";
  if (!f) return -1;
  int got = fgets(b, sizeof b, f) != NULL;
  fclose(f);
  if (!got) return -1;
  if (!strncmp(b, "max", 3)) return INFINITY;
  char *end;
  double v = strtod(b, &end);
  return end == b ? -1 : v >= 9e18 ? INFINITY : v; /* v1 says "unlimited" with ~2^63 */
}

/* The tightest memory cgroup limit on this process (v2, else v1): room left under it in
 * *room, the limit in *limit; 0 when there is one, -1 when none applies. */
static int cgroup_room(double *room, double *limit) {
  FILE *f = fopen("/proc/self/cgroup", "re");
  char line[512], dir[600];
  int found = -1;
  *room = *limit = INFINITY;
  while (f && fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    int v2 = !strncmp(line, "0::", 3);
    const char *path = v2                         ? line + 3
                       : strstr(line, ":memory:") ? strstr(line, ":memory:") + 8
                                                  : NULL;
    if (!path) continue;
    const char *base = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    const char *max = v2 ? "memory.max" : "memory.limit_in_bytes";
    const char *cur = v2 ? "memory.current" : "memory.usage_in_bytes";
    /* From the process's own cgroup up to the root (a container sees its own as the root). */
    snprintf(dir, sizeof dir, "%s%s", base, path);
    for (;;) {
      char pm[700], pc[700];
      snprintf(pm, sizeof pm, "%s/%s", dir, max), snprintf(pc, sizeof pc, "%s/%s", dir, cur);
      double m = read_number(pm), u = read_number(pc);
      if (m > 0 && m < INFINITY && u >= 0 && m - u < *room) *room = m - u, *limit = m, found = 0;
      char *slash = strrchr(dir, '/');
      if (!slash || (size_t)(slash - dir) < strlen(base)) break;
      *slash = '\0';
    }
  }
  if (f) fclose(f);
  return found;
}

static double mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "re");
  char line[256];
  double kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
  if (f) fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

/* epcomm's CPU segments are memfds: shmem pages, charged to the memory cgroup and taken from RAM
 * (or swap) as they are touched. /dev/shm's size does not limit them. */
static void check_segments(dr_checks_t *c, uint64_t need) {
  double ram = mem_available(), room, limit;
  int cg = cgroup_room(&room, &limit) == 0;
  double have = cg && room < ram ? room : ram;
  char where[160];
  if (cg)
    snprintf(where, sizeof where,
             "%.1f GiB RAM available, %.1f GiB left under the memory "
             "cgroup's limit of %.1f GiB",
             ram / GIB, room / GIB, limit / GIB);
  else
    snprintf(where, sizeof where, "%.1f GiB RAM available, no memory cgroup limit", ram / GIB);
  int st = have < 0 ? DR_INFO : have < (double)need ? DR_FAIL : have < 2.0 * need ? DR_WARN : DR_OK;
  dr_check_add(c, "shared memory", st,
               st == DR_FAIL || st == DR_WARN
                   ? "segments count against RAM and the memory cgroup, not /dev/shm: raise the "
                     "container's memory limit (docker --memory) or use smaller queues "
                     "(EP_QUEUE_BYTES, fewer EP_CHANNELS)"
                   : "",
               "epcomm segments (memfd): %s; this config needs %.1f MiB (--config-bytes)", where,
               (double)need / MIB);
}

static void limit_text(rlim_t v, int bytes, char *out, size_t len) {
  if (v == RLIM_INFINITY)
    snprintf(out, len, "unlimited");
  else if (bytes)
    snprintf(out, len, "%.1f MiB", (double)v / MIB);
  else
    snprintf(out, len, "%llu", (unsigned long long)v);
}

static void check_limits(dr_checks_t *c) {
  struct rlimit ml, nf;
  char s[32], h[32];
  getrlimit(RLIMIT_MEMLOCK, &ml);
  limit_text(ml.rlim_cur, 1, s, sizeof s), limit_text(ml.rlim_max, 1, h, sizeof h);
  int low = ml.rlim_cur != RLIM_INFINITY && ml.rlim_cur < 64ull << 20;
  dr_check_add(
      c, "ulimit memlock", low ? DR_WARN : DR_OK,
      low ? "ulimit -l unlimited (docker: --ulimit memlock=-1); pinned and RDMA-registered "
            "memory count against it"
          : "",
      "locked memory: soft %s, hard %s", s, h);
  getrlimit(RLIMIT_NOFILE, &nf);
  limit_text(nf.rlim_cur, 0, s, sizeof s), limit_text(nf.rlim_max, 0, h, sizeof h);
  low = nf.rlim_cur != RLIM_INFINITY && nf.rlim_cur < 4096;
  dr_check_add(
      c, "ulimit nofile", low ? DR_WARN : DR_OK,
      low ? "ulimit -n 65536: every peer costs sockets, shared-memory and IPC descriptors" : "",
      "open files: soft %s, hard %s", s, h);
}

/* ---- environment variables ------------------------------------------------------------------- */

/* Returns a status for the value and may point *fix at advice. */
typedef int (*judge_fn)(const char *v, const char **fix);

static int is_one(const char *v) {
  return !strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes");
}

static int judge_p2p_disable(const char *v, const char **fix) {
  *fix =
      "unset it: without P2P the GPUs of one host exchange data through host memory, at a "
      "fraction of NVLink bandwidth";
  return is_one(v) ? DR_WARN : DR_INFO;
}
static int judge_p2p_level(const char *v, const char **fix) {
  *fix = "unset it (LOC/0 disables P2P, as NCCL_P2P_DISABLE=1 does)";
  return !strcmp(v, "LOC") || !strcmp(v, "0") ? DR_WARN : DR_INFO;
}
static int judge_nvls(const char *v, const char **fix) {
  *fix = "set NCCL_NVLS_ENABLE=0 on shared hosts (MIG, MPS, several jobs per node)";
  return strcmp(v, "0") ? DR_WARN : DR_OK;
}
static int judge_nvshmem_nvls(const char *v, const char **fix) {
  *fix = "set NVSHMEM_DISABLE_NVLS=1 on shared hosts";
  return is_one(v) ? DR_OK : DR_WARN;
}
static int judge_visible(const char *v, const char **fix) {
  *fix = "unset it or list device indices or UUIDs: this value hides every GPU";
  return !*v || !strcmp(v, "-1") || !strcasecmp(v, "none") || !strcasecmp(v, "NoDevFiles")
             ? DR_FAIL
             : DR_INFO;
}
static int judge_use_nccl(const char *v, const char **fix) {
  *fix =
      "NVSHMEM_USE_NCCL is read when NVSHMEM (and DeepEP) are built, not at run time: rebuild "
      "with it, or set NVSHMEM_DISABLE_NCCL=1 at run time";
  return DR_INFO;
}
static int judge_launch_blocking(const char *v, const char **fix) {
  *fix = "unset it outside debugging: every kernel launch waits, nothing overlaps";
  return is_one(v) ? DR_WARN : DR_INFO;
}
/* Advice beyond validity (the library's registry checks the form). */
static int judge_timeout(const char *v, const char **fix) {
  *fix =
      "a deadline under a second turns a slow rank start (CUDA context: seconds) into "
      "EP_ERR_TIMEOUT";
  return strtod(v, NULL) < 1 ? DR_WARN : DR_OK;
}
static int judge_deprecated(const char *v, const char **fix) {
  *fix =
      "PyTorch reads the TORCH_-prefixed name now (TORCH_NCCL_ASYNC_ERROR_HANDLING, "
      "TORCH_NCCL_BLOCKING_WAIT)";
  return DR_WARN;
}

static const struct {
  const char *name, *what;
  judge_fn judge;
} env_docs[] = {
    {"NCCL_DEBUG", "NCCL log level (VERSION, WARN, INFO, TRACE)", NULL},
    {"NCCL_DEBUG_SUBSYS", "NCCL subsystems to log (INIT, COLL, P2P, SHM, NET, ENV, ...)", NULL},
    {"NCCL_DEBUG_FILE", "NCCL log file (%h host, %p pid)", NULL},
    {"NCCL_P2P_DISABLE", "disables NCCL's direct GPU-to-GPU transport (NVLink/PCIe)",
     judge_p2p_disable},
    {"NCCL_P2P_LEVEL", "largest GPU distance at which NCCL uses P2P", judge_p2p_level},
    {"NCCL_SHM_DISABLE", "disables NCCL's host shared-memory transport", NULL},
    {"NCCL_NVLS_ENABLE", "NVLink SHARP (multicast) collectives", judge_nvls},
    {"NCCL_CUMEM_ENABLE", "NCCL allocates with the cuMem* virtual memory API", NULL},
    {"NCCL_IB_DISABLE", "disables the InfiniBand/RoCE transport (sockets instead)",
     dr_judge_ib_disable},
    {"NCCL_IB_HCA", "InfiniBand adapters NCCL may use", NULL},
    {"NCCL_SOCKET_IFNAME", "network interfaces for NCCL's sockets and bootstrap",
     dr_judge_socket_ifname},
    {"NCCL_HOSTID", "host identity NCCL uses instead of the hostname", NULL},
    {"NCCL_NET_GDR_LEVEL", "largest distance for GPUDirect RDMA", NULL},
    {"NCCL_ALGO", "forces collective algorithms", NULL},
    {"NCCL_PROTO", "forces protocols (LL, LL128, Simple)", NULL},
    {"NCCL_BUFFSIZE", "bytes of each NCCL channel buffer", NULL},
    {"NCCL_MIN_NCHANNELS", "lower bound on NCCL channels (thread blocks)", NULL},
    {"NCCL_MAX_NCHANNELS", "upper bound on NCCL channels (thread blocks)", NULL},
    {"NCCL_TOPO_FILE", "XML topology NCCL reads instead of probing", NULL},
    {"NCCL_COMM_BLOCKING", "blocking (1) or non-blocking (0) communicator calls", NULL},
    {"NCCL_ASYNC_ERROR_HANDLING", "old PyTorch name of TORCH_NCCL_ASYNC_ERROR_HANDLING",
     judge_deprecated},
    {"NCCL_BLOCKING_WAIT", "old PyTorch name of TORCH_NCCL_BLOCKING_WAIT", judge_deprecated},
    {"NVSHMEM_DEBUG", "NVSHMEM log level (VERSION, WARN, INFO, ABORT, TRACE)", NULL},
    {"NVSHMEM_INFO", "prints NVSHMEM's variables at startup", NULL},
    {"NVSHMEM_SYMMETRIC_SIZE", "bytes of the symmetric heap per PE", NULL},
    {"NVSHMEM_BOOTSTRAP", "how PEs find each other (PMI, MPI, SHMEM, plugin, UID)", NULL},
    {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "interface of the UID bootstrap", NULL},
    {"NVSHMEM_REMOTE_TRANSPORT", "inter-node transport (ibrc, ucx, libfabric, ibdevx, none)", NULL},
    {"NVSHMEM_IB_ENABLE_IBGDA", "GPU-initiated InfiniBand (IBGDA)", NULL},
    {"NVSHMEM_DISABLE_P2P", "disables NVSHMEM's intranode P2P", NULL},
    {"NVSHMEM_DISABLE_NVLS", "disables NVLink SHARP in NVSHMEM", judge_nvshmem_nvls},
    {"NVSHMEM_DISABLE_NCCL", "stops NVSHMEM from using NCCL for collectives at run time", NULL},
    {"NVSHMEM_USE_NCCL", "NVSHMEM build option: compile NCCL support in", judge_use_nccl},
    {"CUDA_VISIBLE_DEVICES", "GPUs this process may see, and their order", judge_visible},
    {"CUDA_DEVICE_ORDER", "FASTEST_FIRST (default) or PCI_BUS_ID numbering", NULL},
    {"CUDA_LAUNCH_BLOCKING", "makes every kernel launch synchronous", judge_launch_blocking},
    {"CUDA_DEVICE_MAX_CONNECTIONS", "hardware work queues per device (1 serialises streams)", NULL},
    {"CUDA_MPS_PIPE_DIRECTORY", "where MPS clients find the daemon's pipes", NULL},
    {"CUDA_MPS_LOG_DIRECTORY", "MPS daemon log directory", NULL},
    {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "share of SMs an MPS client may use", NULL},
    {"CUDA_MODULE_LOADING", "LAZY or EAGER kernel loading", NULL},
    {"CUDA_HOME", "CUDA toolkit location (build tools)", NULL},
};
#define NDOCS (sizeof env_docs / sizeof env_docs[0])

static int has_prefix(const char *s) {
  return !strncmp(s, "NCCL_", 5) || !strncmp(s, "NVSHMEM_", 8) || !strncmp(s, "EP_", 3) ||
         !strncmp(s, "CUDA_", 5);
}

/* EP_* names: the library's registry says what each does and whether the value is valid (an
 * invalid one fails group and buffer creation: FAIL); then the tool's own variables. */
static void check_ep_variable(dr_checks_t *c, const char *name, const char *val) {
  const ep_env_var_t *v = ep_env_var_find(name);
  if (v && ep_env_check_value(name, val) != EP_OK) {
    char fix[320];
    snprintf(fix, sizeof fix, "set it to %s, or unset it (default: %s)", v->accepted,
             *v->default_value ? v->default_value : "derived");
    dr_check_add(c, name, DR_FAIL, fix,
                 "%s (ep_group_create and ep_buffer_create fail with "
                 "EP_ERR_INVALID_ARG)",
                 ep_last_error());
    return;
  }
  const char *fix = "";
  int st = v && !strcmp(name, "EP_TIMEOUT_S") && *val ? judge_timeout(val, &fix) : DR_INFO;
  if (!v) v = cli_env_var_find(name);
  if (v && !strcmp(v->type, "secret")) val = "(set, not shown)"; /* never print the job key */
  if (v) {
    dr_check_add(c, name, st, st == DR_WARN ? fix : "", "=%s: %s (%s)", val, v->description,
                 v->module);
    return;
  }
  dr_check_add(c, name, DR_WARN,
               "epcomm does not read this name: check its spelling (epcomm info lists them)",
               "=%s: unknown EP_ variable", val);
}

static void check_variable(dr_checks_t *c, const char *entry) {
  size_t k = strcspn(entry, "=");
  char name[128];
  snprintf(name, sizeof name, "%.*s", (int)k, entry);
  const char *val = entry[k] ? entry + k + 1 : "";
  if (!strncmp(name, "EP_", 3)) {
    check_ep_variable(c, name, val);
    return;
  }
  for (size_t i = 0; i < NDOCS; i++) {
    if (strcmp(env_docs[i].name, name)) continue;
    const char *fix = "";
    int st = env_docs[i].judge ? env_docs[i].judge(val, &fix) : DR_INFO;
    dr_check_add(c, name, st, st == DR_WARN || st == DR_FAIL ? fix : "", "=%s: %s", val,
                 env_docs[i].what);
    return;
  }
  /* Other prefixes have far more variables than this table: unknown is no reason to warn. */
  dr_check_add(c, name, DR_INFO, "", "=%s: not in the doctor's table", val);
}

/* Advice about variables that matter by being absent. */
static void check_unset(dr_checks_t *c, const env_state_t *st) {
  if (!getenv("NCCL_DEBUG"))
    dr_check_add(c, "NCCL_DEBUG", st->have_lib ? DR_WARN : DR_INFO,
                 "export NCCL_DEBUG=WARN (INFO to see init and teardown) before reading a failure",
                 "unset: NCCL errors surface as bare result codes without their cause");
  if (!getenv("NCCL_NVLS_ENABLE"))
    dr_check_add(
        c, "NCCL_NVLS_ENABLE", st->ngpu > 1 ? DR_WARN : DR_INFO,
        st->ngpu > 1 ? "on shared hosts (MIG, MPS, several jobs) set NCCL_NVLS_ENABLE=0" : "",
        "unset: NCCL uses NVLink SHARP where NVSwitch offers it");
  if (!getenv("NVSHMEM_USE_NCCL"))
    dr_check_add(
        c, "NVSHMEM_USE_NCCL", DR_INFO,
        "to drop the NCCL dependency of NVSHMEM/DeepEP rebuild with NVSHMEM_USE_NCCL=0, or "
        "set NVSHMEM_DISABLE_NCCL=1 at run time",
        "unset: an NVSHMEM or DeepEP built in this shell would link NCCL and start its threads");
}

static void check_variables(dr_checks_t *c, const env_state_t *st) {
  size_t before = c->n;
  for (char **e = environ; *e; e++)
    if (has_prefix(*e)) check_variable(c, *e);
  if (c->n == before)
    dr_check_add(c, "variables", DR_INFO, "", "no NCCL_*, NVSHMEM_*, EP_* or CUDA_* variable set");
  check_unset(c, st);
}

void dr_env_run(dr_checks_t *out, uint64_t config_bytes) {
  cuda_t cu;
  env_state_t st = {.ngpu = -1};
  check_gpus(out, &cu, &st);
  check_peers(out, &cu, &st);
  check_cudart(out, &cu, &st);
  check_nccl(out, &st);
  check_mpi(out);
  dr_net_run(out);
  check_nvshmem(out);
  check_mps(out, &st);
  check_devshm(out);
  check_segments(out, config_bytes);
  check_limits(out);
  check_variables(out, &st);
}
