/* The memory of one CUDA buffer: the exported pool and the peers' pools mapped through CUDA IPC,
 * private device memory, the mapped host block, the handle arena, a side stream and an event.
 * Setup is collective and fails on every rank when it fails on one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cuda/cuda.h"
#include "cuda/cuda_ll.h"

static const char OP[] = "ep_buffer_create";

size_t cuda_pool_layout(int R, int C, size_t queue_bytes, uint64_t ll_bytes, uint64_t *off_ll,
                        epk_buf_t *kb) {
  uint64_t r = (uint64_t)R, off;
  kb->slot_bytes = epk_al(sizeof(epk_hello_t) + 4 * (r + EP_MAX_LOCAL_EXPERTS), 128);
  kb->off_hello = 0;
  off = 2 * r * kb->slot_bytes;
  uint64_t *flags[] = {&kb->off_arrive, &kb->off_consumed, &kb->off_staged, &kb->off_cdone};
  for (int i = 0; i < 4; i++) {
    *flags[i] = epk_al(off, 128);
    off = *flags[i] + epk_al(4 * r, 128);
  }
  kb->off_ctab = epk_al(off, 128);
  off = kb->off_ctab + 32 * r;
  kb->area_bytes = epk_al(r * (uint64_t)C * queue_bytes, 4096);
  kb->off_area_d = epk_al(off, 4096);
  kb->off_area_c = kb->off_area_d + kb->area_bytes;
  *off_ll = epk_al(kb->off_area_c + kb->area_bytes, 4096);
  kb->pool_bytes = *off_ll + ll_bytes;
  return kb->pool_bytes;
}

/* What every rank tells the others at create. */
typedef struct {
  cudaIpcMemHandle_t handle;
  unsigned char uuid[16];
  int32_t ok, sms, want_blocks, pad;
  int32_t pci[3]; /* domain, bus, device */
  int32_t pad2;
} peer_info_t;

/* EP_CUDA_L2_HINT: from how many bytes of rows, over all ranks, a call streams them through L2
 * (cuda_l2_stream), for a GPU of l2 bytes of L2. auto: a fifth of it (10.5 MB on an H100),
 * between the calls measured slower with the hint (bf16, R = 2, 128 tokens: ~7.3 MB) and faster
 * (fp8, R = 4, 128 tokens: ~13.2 MB; docs/PERFORMANCE.md); a GPU that does not say: never. */
static uint64_t l2_stream_bytes(int l2) {
  const char *v = ep_env_text("EP_CUDA_L2_HINT");
  if (v && !strcasecmp(v, "on")) return 0;
  if ((v && !strcasecmp(v, "off")) || l2 <= 0) return UINT64_MAX;
  return (uint64_t)l2 / 5;
}

static ep_status_t pick_device(cuda_state_t *s, const ep_buffer_config_t *cfg) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    return ep_ctx_fail(s->ctx, EP_ERR_UNSUPPORTED, -1, OP, "init", "no CUDA device (%s)",
                       e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  long env = ep_env_long("EP_CUDA_DEVICE", -1), local = ep_env_long("EP_LOCAL_RANK", -1);
  int dev = cfg->cuda_device;
  if (dev < 0 && env >= 0) dev = (int)env;
  if (dev < 0 && local >= 0) dev = (int)(local % n);
  if (dev < 0 && cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  if (dev >= n)
    return ep_ctx_fail(s->ctx, EP_ERR_OUT_OF_RANGE, -1, OP, "init",
                       "cuda_device %d, but %d devices are visible", dev, n);
  s->device = dev;
  return cuda_check(s, cudaSetDevice(dev), OP, "init");
}

/* Steps that touch nothing of the peers: device, pool, IPC export. */
static ep_status_t local_setup(cuda_state_t *s, const ep_buffer_config_t *cfg, peer_info_t *me) {
  ep_status_t st = pick_device(s, cfg);
  if (st) return st;
  struct cudaDeviceProp p;
  if ((st = cuda_check(s, cudaGetDeviceProperties(&p, s->device), OP, "init"))) return st;
  memcpy(me->uuid, p.uuid.bytes, 16);
  me->pci[0] = p.pciDomainID, me->pci[1] = p.pciBusID, me->pci[2] = p.pciDeviceID;
  s->l2_stream_bytes = l2_stream_bytes(p.l2CacheSize);
  me->sms = p.multiProcessorCount;
  me->want_blocks = cfg->num_sms > 0 ? cfg->num_sms : (int)ep_env_int("EP_CUDA_SMS");
  epk_ll_layout_t ll;
  uint64_t ll_bytes = cuda_ll_region_bytes(cfg, s->nranks, &ll);
  size_t bytes =
      cuda_pool_layout(s->nranks, s->channels, s->queue_bytes, ll_bytes, &s->off_ll, &s->kb);
  if ((st = cuda_check(s, cudaMalloc((void **)&s->pool, bytes), OP, "pool"))) return st;
  if ((st = cuda_check(s, cudaMemset(s->pool, 0, s->kb.off_area_d), OP, "pool"))) return st;
  /* Flags and entry records start at zero before any peer can see the pool (the exchange). */
  if (ll_bytes &&
      (st = cuda_check(s, cudaMemset(s->pool + s->off_ll, 0, ll.zero_bytes), OP, "pool")))
    return st;
  return cuda_check(s, cudaIpcGetMemHandle(&me->handle, s->pool), OP, "export");
}

/* Blocks of every rank's kernels: its config (else 24, DeepEP's budget per rank on one node),
 * never more than its GPU's SMs shared among the ranks on that GPU. The kernels of the ranks
 * wait on each other, so all their blocks must be resident at once (one block fills an SM).
 * Every rank computes the same table. */
static int fair_share(const peer_info_t *all, int R, int r) {
  int same = 0;
  for (int q = 0; q < R; q++) same += !memcmp(all[q].uuid, all[r].uuid, 16);
  int fit = all[r].sms / (same ? same : 1);
  return fit < 1 ? 1 : fit;
}

static void block_table(const peer_info_t *all, int R, int32_t *blocks) {
  for (int r = 0; r < R; r++) {
    int fit = fair_share(all, R, r), want = all[r].want_blocks > 0 ? all[r].want_blocks : 24;
    blocks[r] = want < fit ? want : fit;
  }
}

/* Whether every rank runs on this GPU (one host, one device UUID and PCI address; a MIG
 * instance has its own UUID): the normal-mode kernels then order their flags between ranks at
 * .gpu scope, which is cheaper than .sys (common.cuh). An all-zero UUID (a virtualised device
 * may report one) proves nothing: .sys. EP_CUDA_SCOPE=sys keeps .sys, as for peers on other
 * GPUs; ranks that differ in it still agree, since either scope orders ranks on one GPU. */
static int one_gpu(const cuda_state_t *s, const peer_info_t *all) {
  static const unsigned char zero[16];
  const peer_info_t *me = &all[s->rank];
  const char *v = ep_env_text("EP_CUDA_SCOPE");
  if ((v && !strcasecmp(v, "sys")) || ep_ctx_topo(s->ctx)->nhosts > 1 ||
      !memcmp(me->uuid, zero, 16))
    return 0;
  for (int r = 0; r < s->nranks; r++)
    if (memcmp(all[r].uuid, me->uuid, 16) || memcmp(all[r].pci, me->pci, sizeof me->pci)) return 0;
  return 1;
}

static ep_status_t open_peers(cuda_state_t *s, const peer_info_t *all) {
  for (int r = 0; r < s->nranks; r++) s->pool_handles[r] = all[r].handle;
  const ep_topo_t *t = ep_ctx_topo(s->ctx);
  for (int r = 0; r < s->nranks; r++) {
    if (r == s->rank) {
      s->peer_ptrs[r] = s->pool;
      continue;
    }
    /* Across hosts only the ranks of this host are mapped; the others are reached through the
     * network engine (cuda_net.c). */
    if (t->host_of[r] != t->host) continue;
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, all[r].handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      return ep_ctx_fail(s->ctx, EP_ERR_CUDA, r, OP, "map",
                         "cannot map rank %d's buffer: %s (no peer access between the GPUs?)", r,
                         cudaGetErrorString(e));
    s->peer_ptrs[r] = p;
    s->opened[r] = true;
  }
  return EP_OK;
}

/* Private device memory: control words, peer table, block table, registration table, expert
 * scratch, the notify plan's scratch (all zero: the plan's scratch must be). */
static ep_status_t private_setup(cuda_state_t *s, const int32_t *blocks) {
  int R = s->nranks;
  size_t o_peers = epk_al(sizeof(epk_priv_t), 256), o_blocks = o_peers + epk_al(8ull * R, 256);
  size_t o_regs = o_blocks + epk_al(4ull * R, 256);
  size_t o_ecount = o_regs + epk_al(16ull * EP_MAX_MEM_REGS * R, 256); /* pointers, sizes */
  size_t o_pscr = o_ecount + epk_al(4ull * EP_MAX_LOCAL_EXPERTS * R, 256);
  size_t o_pec = o_pscr + epk_al(sizeof(epk_plan_scr_t), 256);
  size_t bytes = o_pec + 4ull * EP_MAX_LOCAL_EXPERTS * R;
  ep_status_t st = cuda_check(s, cudaMalloc(&s->priv_mem, bytes), OP, "private memory");
  if (st) return st;
  uint8_t *m = s->priv_mem;
  if ((st = cuda_check(s, cudaMemset(m, 0, bytes), OP, "private memory")) ||
      (st = cuda_check(s, cudaMemcpy(m + o_peers, s->peer_ptrs, 8ull * R, cudaMemcpyHostToDevice),
                       OP, "private memory")) ||
      (st = cuda_check(s, cudaMemcpy(m + o_blocks, blocks, 4ull * R, cudaMemcpyHostToDevice), OP,
                       "private memory")))
    return st;
  s->kb.priv = (epk_priv_t *)m;
  s->kb.peers = (uint8_t *const *)(m + o_peers);
  s->kb.peer_blocks = (const int32_t *)(m + o_blocks);
  s->reg_table = (uint8_t **)(m + o_regs);
  s->kb.regs = s->reg_table;
  s->reg_bytes = (uint64_t *)(m + o_regs + 8ull * EP_MAX_MEM_REGS * R);
  s->kb.reg_bytes = s->reg_bytes;
  s->kb.ecount = (int32_t *)(m + o_ecount);
  s->kb.pscr = (epk_plan_scr_t *)(m + o_pscr);
  s->kb.pec = (int32_t *)(m + o_pec);
  s->kb.blocks = blocks[s->rank];
  return EP_OK;
}

static ep_status_t host_setup(cuda_state_t *s) {
  ep_status_t st =
      cuda_check(s, cudaHostAlloc((void **)&s->host, sizeof(epk_host_t), cudaHostAllocMapped), OP,
                 "host block");
  if (st) return st;
  memset(s->host, 0, sizeof *s->host);
  void *dev = NULL;
  if ((st = cuda_check(s, cudaHostGetDevicePointer(&dev, s->host, 0), OP, "host block"))) return st;
  s->kb.host = dev;
  long mib = ep_env_int("EP_CUDA_ARENA_MB");
  if ((st = cuda_arena_new((size_t)(mib > 1 ? mib : 1) << 20, &s->arena))) return st;
  if ((st =
           cuda_check(s, cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking), OP, "stream")))
    return st;
  return cuda_check(s, cudaEventCreateWithFlags(&s->last, cudaEventDisableTiming), OP, "event");
}

/* Every rank learns whether every other rank got this far. */
static ep_status_t agree(cuda_state_t *s, ep_status_t mine) {
  int32_t ok = mine == EP_OK, *all = calloc((size_t)s->nranks, sizeof *all);
  if (!all) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "init", "out of memory");
  ep_status_t st = ep_ctx_allgather(s->ctx, &ok, all, sizeof ok);
  for (int r = 0; r < s->nranks && !st; r++)
    if (!all[r] && mine == EP_OK)
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, OP, "init",
                       "rank %d could not set up its CUDA buffer (see its error)", r);
  free(all);
  return mine ? mine : st;
}

static ep_status_t exchange(cuda_state_t *s, const ep_buffer_config_t *cfg) {
  int R = s->nranks;
  peer_info_t me, *all = calloc((size_t)R, sizeof *all);
  int32_t *blocks = calloc((size_t)R, sizeof *blocks);
  memset(&me, 0, sizeof me);
  if (!all || !blocks) {
    free(all), free(blocks);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "init", "out of memory");
  }
  ep_status_t mine = local_setup(s, cfg, &me);
  me.ok = mine == EP_OK;
  ep_status_t st = ep_ctx_allgather(s->ctx, &me, all, sizeof me);
  for (int r = 0; r < R && !st && !mine; r++)
    if (!all[r].ok)
      st = ep_ctx_fail(s->ctx, EP_ERR_PEER_INVALID, r, OP, "init",
                       "rank %d could not set up its CUDA buffer (see its error)", r);
  if (!st && !mine) {
    block_table(all, R, blocks);
    s->fit_blocks = fair_share(all, R, s->rank);
    s->kb.one_gpu = one_gpu(s, all);
    mine = open_peers(s, all);
    if (!mine) mine = private_setup(s, blocks);
    if (!mine) mine = host_setup(s);
    if (!mine) mine = cuda_ll_create(s, cfg);
    /* The error word's reset first runs while other kernels may wait for peers: launched once
     * here (a no-op), so that lazy module loading (the default) never loads it then, which may
     * wait for the running kernels. Before the ranks agree: a failure is everyone's. */
    if (!mine) mine = cuda_check(s, epk_launch_clear_err(&s->kb, 0, s->side), OP, "load");
    if (!mine) mine = cuda_check(s, cudaDeviceSynchronize(), OP, "init");
    st = agree(s, mine);
  }
  free(all), free(blocks);
  return mine ? mine : st;
}

ep_status_t cuda_mem_setup(cuda_state_t *s, const ep_buffer_config_t *cfg) {
  s->peer_ptrs = calloc((size_t)s->nranks, sizeof *s->peer_ptrs);
  s->opened = calloc((size_t)s->nranks, sizeof *s->opened);
  s->pool_handles = calloc((size_t)s->nranks, sizeof *s->pool_handles);
  if (!s->peer_ptrs || !s->opened || !s->pool_handles)
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, OP, "init", "out of memory");
  s->kb.rank = s->rank;
  s->kb.nranks = s->nranks;
  s->kb.timeout_ns = (uint64_t)(ep_ctx_timeout(s->ctx) * 1e9);
  return exchange(s, cfg);
}

/* Collective: nobody frees its pool while a peer may still have it mapped and in use. */
void cuda_mem_teardown(cuda_state_t *s, bool collective) {
  if (s->device >= 0) cudaSetDevice(s->device);
  cuda_ll_destroy(s);
  cuda_reg_teardown(s);
  for (int r = 0; s->opened && r < s->nranks; r++)
    if (s->opened[r]) cudaIpcCloseMemHandle(s->peer_ptrs[r]);
  if (collective) ep_ctx_barrier(s->ctx);
  if (s->last) cudaEventDestroy(s->last);
  if (s->side) cudaStreamDestroy(s->side);
  if (s->arena) cuda_arena_unref(s->arena);
  if (s->host) cudaFreeHost(s->host);
  if (s->priv_mem) cudaFree(s->priv_mem);
  if (s->pool) cudaFree(s->pool);
  free(s->peer_ptrs);
  free(s->opened);
  free(s->pool_handles);
}
