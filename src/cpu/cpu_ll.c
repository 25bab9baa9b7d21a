/* Low-latency mode of the CPU backend: the region's layout, the per-buffer state, result slots,
 * views. The protocol is described in cpu_ll.h. */
#include "cpu_ll.h"

#include <stdlib.h>
#include <string.h>

static size_t al(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

/* One function lays out the region for the size hint, the segment and every access. */
static void ll_layout(int T, int H, int E, int K, int R, cpu_ll_layout_t *l) {
  size_t L = (size_t)E / (size_t)R, RT = (size_t)R * (size_t)T, o = 0;
  memset(l, 0, sizeof *l);
  l->arrive_bytes = al(sizeof(cpu_ll_arrive_t) + sizeof(int32_t) * (size_t)E, CPU_CL);
  l->creject = 2 * l->arrive_bytes;
  l->slots = al(l->creject + CPU_CL, 4096);
  l->data = o, o += (size_t)R * CPU_CL;
  l->comb = o, o += (size_t)R * CPU_CL;
  l->count = o, o += al(sizeof(int32_t) * L, CPU_CL);
  l->range = o, o += al(sizeof(int64_t) * L * (size_t)R, CPU_CL);
  l->src = o, o += al(sizeof(int32_t) * L * RT, CPU_CL);
  l->route = o, o += al(sizeof(int32_t) * L * RT, CPU_CL);
  /* bf16 rows take 2H bytes; fp8 rows (H) and their scales (at most 4H/128) fit in the same. */
  l->slab = o = al(o, 4096), o += al(L * RT * 2 * (size_t)H, 4096);
  l->area = o, o += al((size_t)T * (size_t)K * 2 * (size_t)H, 4096);
  l->cin = o, o += al(L * RT * 2 * (size_t)H, 4096); /* zero-copy combine input (bf16) */
  l->slot_bytes = o;
  l->total = l->slots + CPU_LL_SLOTS * o;
}

size_t cpu_ll_region_bytes(const ep_buffer_config_t *cfg, int nranks) {
  if (!cfg || !cfg->ll_max_tokens || nranks < 1) return 0;
  cpu_ll_layout_t l;
  ll_layout(cfg->ll_max_tokens, cfg->ll_hidden, cfg->ll_num_experts, cfg->ll_max_topk, nranks, &l);
  return l.total;
}

static void slot_free_mem(cpu_ll_slot_t *sl) {
  free(sl->src_slot), free(sl->idx), free(sl->w), free(sl->use);
}

void cpu_ll_destroy(cpu_state_t *s) {
  cpu_ll_t *ll = s->ll;
  if (!ll) return;
  for (int i = 0; i < CPU_LL_SLOTS; i++) slot_free_mem(&ll->slot[i]);
  free(ll->cast), free(ll->sel), free(ll->pos), free(ll->rows);
  free(ll);
  s->ll = NULL;
}

static bool slot_init(cpu_state_t *s, cpu_ll_t *ll, int i) {
  cpu_ll_slot_t *sl = &ll->slot[i];
  size_t tk = (size_t)ll->T * (size_t)ll->K;
  sl->index = i;
  sl->ll = ll;
  sl->base = cpu_ll_slot_base(s, s->rank, i);
  sl->src_slot = malloc(sizeof(int32_t) * (size_t)ll->R);
  sl->idx = malloc(sizeof(int64_t) * tk);
  sl->w = malloc(sizeof(float) * tk);
  sl->use = malloc(tk);
  return sl->src_slot && sl->idx && sl->w && sl->use;
}

ep_status_t cpu_ll_create(cpu_state_t *s, const ep_buffer_config_t *cfg) {
  if (!cfg->ll_max_tokens) return EP_OK;
  cpu_ll_t *ll = calloc(1, sizeof *ll);
  if (!ll) return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init", "oom");
  s->ll = ll;
  ll->T = cfg->ll_max_tokens, ll->H = cfg->ll_hidden, ll->E = cfg->ll_num_experts;
  ll->K = cfg->ll_max_topk, ll->R = s->gnranks;
  ll->L = ll->E / ll->R, ll->RT = ll->R * ll->T, ll->NS = ll->H / 128;
  ll_layout(ll->T, ll->H, ll->E, ll->K, ll->R, &ll->lay);
  ll->cast = malloc((size_t)ll->T * ((size_t)ll->H + 4 * (size_t)ll->NS) + 1);
  ll->sel = malloc(sizeof(int32_t) * (size_t)ll->E);
  ll->pos = malloc(sizeof(int32_t) * (size_t)ll->E * (size_t)s->channels);
  ll->rows = malloc(sizeof(*ll->rows) * (size_t)ll->K * (size_t)s->channels);
  bool ok = ll->cast && ll->sel && ll->pos && ll->rows;
  for (int i = 0; i < CPU_LL_SLOTS; i++) ok = slot_init(s, ll, i) && ok;
  if (!ok) {
    cpu_ll_destroy(s);
    return ep_ctx_fail(s->ctx, EP_ERR_NO_MEMORY, -1, "ep_buffer_create", "init",
                       "out of memory for the low-latency state");
  }
  cpu_ll_kernels_pick(&ll->k);
  long wide = ep_env_int("EP_LL_WIDE_BYTES");
  ll->wide_bytes = wide > 0 ? (size_t)wide : 0;
  return EP_OK;
}

void cpu_ll_run(cpu_state_t *s, size_t bytes, int *parts,
                ep_status_t (*fn)(cpu_state_t *, void *, int), void *job) {
  *parts = s->channels > 1 && bytes >= s->ll->wide_bytes ? s->channels : 1;
  if (*parts > 1)
    cpu_run_channels(s, fn, job);
  else
    fn(s, job, 0);
}

void cpu_ll_release(void *state, ep_handle_info_t *h) {
  cpu_state_t *s = state;
  cpu_ll_slot_t *sl = h->priv;
  if (!sl) return;
  if (s->net) cpu_net_ll_settle(s, sl); /* a receive it never made still arrives */
  sl->state = LL_FREE;
}

ep_status_t cpu_ll_view(const ep_handle_info_t *h, ep_ll_recv_view_t *v) {
  const cpu_ll_slot_t *sl = h->priv;
  /* A slot's arrays never move: a two-phase caller may learn where its rows will land before
   * they do (DeepEP's return_recv_hook returns the tensors first); contents follow ep_ll_recv. */
  if (sl->state == LL_FREE || sl->state == LL_FAILED)
    return ep_err(EP_ERR_INVALID_ARG, "ep_ll_get_recv_view: no view: %s",
                  ep_ll_state_why(sl->state));
  const cpu_ll_t *ll = sl->ll;
  unsigned char *slab = sl->base + ll->lay.slab;
  v->num_local_experts = ll->L;
  v->max_rows = ll->RT;
  v->hidden = ll->H;
  v->num_scales = sl->fp8 ? ll->NS : 0;
  v->use_fp8 = sl->fp8, v->round_scale = sl->round_scale, v->use_ue8m0 = sl->ue8m0;
  v->recv_x = slab;
  v->recv_x_scales = sl->fp8 ? slab + (size_t)ll->L * ll->RT * ll->H : NULL;
  v->recv_count = (const int32_t *)(sl->base + ll->lay.count);
  v->recv_src_info = (const int32_t *)(sl->base + ll->lay.src);
  v->recv_layout_range = (const int64_t *)(sl->base + ll->lay.range);
  v->scale_layout = sl->scale_layout;
  return EP_OK;
}

/* The combine reads y wherever it is, so the area is plain memory that the push below reads
 * like any other y: the rows are copied once, straight into their source's area. */
ep_status_t cpu_ll_combine_buffer(const ep_handle_info_t *h, void **y) {
  const cpu_ll_slot_t *sl = h->priv;
  if (sl->state != LL_RECEIVED)
    return ep_err(EP_ERR_INVALID_ARG,
                  "ep_ll_get_combine_buffer: the handle cannot be combined: "
                  "%s",
                  ep_ll_state_why(sl->state));
  *y = sl->base + sl->ll->lay.cin;
  return EP_OK;
}

ep_status_t cpu_ll_recv(void *state, ep_handle_info_t *h) {
  cpu_state_t *s = state;
  cpu_ll_slot_t *sl = h->priv;
  cpu_call_begin(s);
  if (sl->state == LL_SENT) return cpu_ll_recv_dispatch(s, sl, "ep_ll_recv");
  if (sl->state == LL_COMB_SENT) return cpu_ll_recv_combine(s, sl, "ep_ll_recv");
  return ep_err(EP_ERR_INVALID_ARG, "ep_ll_recv: the handle has nothing to receive: %s",
                ep_ll_state_why(sl->state));
}
