"""Where the experts' output lives decides a CUDA combine's speed; this times it from PyTorch
(issue 15 item 1: "measured including the experts' write"). Run on a GPU machine, the ranks
sharing the GPU under MPS:

    epcomm launch -n R python bench/py_combine_input.py [--tokens 4096] [--sms 24] [--iters 30]
        [--json F]

DeepEP's sizes (H 7168, topk 8, 256 experts, random distinct experts per token, bf16). One
dispatch, then per form of the combine input, `iters` timed calls after 10 warm-up calls, each
= the experts' write (a device copy of the rows into the input) + `Buffer.combine` (with the
dispatch's topk weights; `--weights 0`: without, as DeepEP's harness combines), bracketed by
CUDA events on the current stream; the slowest rank per call; the median. Forms:

  - tensor: the input is a plain tensor, as PyTorch allocates the experts' output (baseline: the
    library stages it into its buffer first);
  - mem_pool: the input is a tensor made under `torch.cuda.use_mem_pool(Buffer.mem_pool(n).pool)`,
    a fresh one every call (what a layer does), read in place by the peers;
  - combine buffer: the input is `Buffer.get_combine_buffer(handle)`, read in place (the limit:
    the same in-place kernel with nothing allocated).

Then the dispatch (with topk, `num_worst_tokens` = every token of every rank, so its outputs
exist before the call) into plain tensors (baseline: the receiver copies the rows out) and into
tensors of the pool (made under `use_mem_pool`: the senders write recv_x in place).

Last, a MoE layer's step: get_dispatch_layout + dispatch with default outputs (the host waits for
the count, the outputs are allocated then) + the combine of its rows (tools/deepep_time.py times
DeepEP's the same way: "layer"), several ways: the package's defaults, default outputs from the
Buffer's registered pool (``out_pool_bytes``, num_nvl_bytes / 2, with the late hello: the senders
write recv_x there, the combine reads it in place); the same without the spares (the next calls'
outputs made while the dispatch waits for its count, ``epcomm._spares``, off through the
Buffer's ``_spares.enabled``; off and on alternated twice); the same buffer with that pool
switched off (plain tensors while the late hello is still promised: what the promise costs when
the outputs are not registered); a fresh buffer with the out pool and the late hello off (the combine reads recv_x
in place, the dispatch copies it out: parts the late hello's wait from the pool's allocation); and,
the baseline of the same run, a fresh buffer without the out pool (``out_pool_bytes=0``,
``EP_CUDA_LATE_HELLO=0``, no registration: the receiver copies the rows out, the combine stages
them; the package's defaults before the sixteenth session). Then two with ``EP_CUDA_EARLY_DATA=1``
(the rows move while the host waits for the count and allocates): without the out pool, and the out
pool without the late hello.

Rank 0 prints the times in us, the ratio to the baseline and the fraction of the limit reached,
and the in-place counters (`Buffer.in_place_counts`), which say which path each form took;
`--json F` also writes them (with the means) for tools/deepep_side_by_side.sh's report.
"""

import argparse
import json
import os
import statistics

import torch

import epcomm
from epcomm import _mempool, deep_ep
from ranks import event_times, gather

H, TOPK, E = 7168, 8, 256


def slowest(group, times, host, gcs, name, spikes):
    """Per call, the slowest rank's time; (median, mean) over calls, us; then DeepEP's harness's
    statistic, each rank's mean over the calls and the largest of those (tools/deepep_time.py
    times DeepEP so: the mean over calls of each call's slowest rank is never below it, and above
    it by the ranks' jitter; at R = 8 and 128 tokens by 17-19% on an H100). The slowest call, when
    it took over twice the median, goes to spikes with what its slowest rank saw: its host time
    for the call (a host stall: the OS, the interpreter) and whether the garbage collector ran
    in it. A mean far above its median is one or a few such calls, and where they fall (the
    first timed call: warm-up left over; anywhere: a stall) is the first clue."""
    n = len(times)
    alls = gather(group, [*times, *host, *gcs])
    worst = [max(a[i] for a in alls) for i in range(n)]
    med = statistics.median(worst)
    top = max(range(n), key=worst.__getitem__)
    if worst[top] > 2 * med:
        over = sum(t > 2 * med for t in worst)
        r = max(range(len(alls)), key=lambda k: alls[k][top])
        spikes.append(f"{name}: call {top + 1} of {n} took {worst[top] * 1e3:.0f} us (median "
                      f"{med * 1e3:.0f}); {over} call(s) over twice the median; on rank {r}, "
                      f"the slowest, its host took {alls[r][n + top] * 1e3:.0f} us for it, "
                      f"{int(alls[r][2 * n + top])} garbage collection(s) during it")
    rank_mean = max(statistics.fmean(a[:n]) for a in alls)
    return med * 1e3, statistics.fmean(worst) * 1e3, rank_mean * 1e3


def timed(group, fn, iters, name, spikes):
    """fn's time per call by CUDA events (ranks.event_times), with the host's own time per call
    and the garbage collections during it for slowest()'s spikes."""
    times, host, gcs = event_times(fn, iters)
    return slowest(group, times, host, gcs, name, spikes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="rank 0 also writes the figures here (means and medians, us)")
    ap.add_argument("--weights", type=int, default=1, choices=(0, 1),
                    help="combine with the dispatch's topk weights (0: none, as DeepEP's harness "
                         "in tools/deepep_time.py combines)")
    ap.add_argument("--pin", action="store_true",
                    help="bind each rank's main thread (only: the threads CUDA and the library "
                         "started before stay unbound) to a core of its own (rank * cores / R): "
                         "whether the spikes are the scheduler's")
    o = ap.parse_args()
    group = epcomm.init()
    R, me = group.nranks, group.rank
    torch.cuda.set_device(0)
    deep_ep.Buffer.set_num_sms(o.sms)
    gen = torch.Generator().manual_seed(1234 + me)
    # The default outputs' registered pool, with the late hello that lets the senders write
    # into it (both off by default until measured: this bench is that measurement). The buffer
    # reads EP_CUDA_LATE_HELLO when it is created.
    late_env = os.environ.get("EP_CUDA_LATE_HELLO")
    os.environ["EP_CUDA_LATE_HELLO"] = "1"
    # Early data only where a form says so (an EP_CUDA_EARLY_DATA=1 from the caller would put it
    # under the baseline too); put back with the late hello's setting below.
    early_env = os.environ.get("EP_CUDA_EARLY_DATA")
    os.environ["EP_CUDA_EARLY_DATA"] = "0"
    # out_pool_bytes: the default (None: 1.5e9 here), the form the package gives its users.
    buf = deep_ep.Buffer(group, int(3e9), 0, explicitly_destroy=True, device="cuda")
    if o.pin:  # this thread only, after CUDA's and the library's threads were started unbound
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[me * len(cores) // R]})
    try:
        x = torch.randn((o.tokens, H), generator=gen).to(torch.bfloat16).cuda()
        idx = torch.rand((o.tokens, E), generator=gen).topk(TOPK).indices.cuda()
        w = torch.rand((o.tokens, TOPK), generator=gen).cuda()
        tpr, _, tpe, itr, _ = buf.get_dispatch_layout(idx, E)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=tpr,
                                                       is_token_in_rank=itr,
                                                       num_tokens_per_expert=tpe, topk_idx=idx,
                                                       topk_weights=w)
        rows = recv_x.shape[0]
        expert_out = recv_x * 1  # what the experts computed; each form copies it into its input
        plain = torch.empty_like(expert_out)
        W = R * o.tokens  # the worst case: every token of every rank
        mp = buf.mem_pool((rows + W) * H * 2 + W * 64 + (64 << 20))
        cbuf = buf.get_combine_buffer(handle)
        cw = recv_w if o.weights else None

        def tensor():
            plain.copy_(expert_out)
            buf.combine(plain, handle, topk_weights=cw)

        def pool():
            with torch.cuda.use_mem_pool(mp.pool):
                y = torch.empty_like(expert_out)  # a fresh output every call, as a layer makes
            y.copy_(expert_out)
            buf.combine(y, handle, topk_weights=cw)

        def combine_buffer():
            cbuf.copy_(expert_out)
            buf.combine(cbuf, handle, topk_weights=cw)

        args = dict(num_tokens_per_rank=tpr, is_token_in_rank=itr, num_tokens_per_expert=tpe,
                    topk_idx=idx, topk_weights=w, num_worst_tokens=W)

        def dispatch_tensor():
            buf.dispatch(x, **args)

        def dispatch_pool():
            with torch.cuda.use_mem_pool(mp.pool):
                buf.dispatch(x, **args)

        def layer():  # a MoE layer's step, default outputs (the host waits for the count)
            pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, E)
            out = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                               num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)
            buf.combine(out[0], out[4])

        res, dres, spikes = [], [], []
        forms = (("tensor", tensor), ("mem_pool", pool), ("combine buffer", combine_buffer))
        for name, fn in forms:
            c0 = buf.in_place_counts()[0]
            us, mean, rmean = timed(group, fn, o.iters, f"write + combine, {name}", spikes)
            res.append((name, us, buf.in_place_counts()[0] - c0, mean, rmean))
        # The out pool off: a worst-case dispatch would make its outputs there (the baseline row
        # in place too), and inside it rather than in mp (the innermost pool allocates).
        pool_, buf._out_pool = buf._out_pool, None
        for name, fn in (("tensor", dispatch_tensor), ("mem_pool", dispatch_pool)):
            d0 = buf.in_place_counts()[1]
            us, mean, rmean = timed(group, fn, o.iters, f"worst-case dispatch, {name}", spikes)
            dres.append((name, us, buf.in_place_counts()[1] - d0, mean, rmean))
        buf._out_pool = pool_

        def counted(name):
            """The layer step timed on buf: (median, mean, slowest rank's mean) us, and
            (dispatches, combines) of its calls in place. Where two loops' figures are averaged
            (lres, lnospare), the third is the mean of each loop's slowest rank's mean: at least
            DeepEP's statistic over both loops, equal when the same rank is slowest in both."""
            c0 = buf.in_place_counts()
            t = timed(group, layer, o.iters, f"layer step, {name}", spikes)
            c1 = buf.in_place_counts()
            return t, (c1[1] - c0[1], c1[0] - c0[0])

        def fresh(name, env, pool_bytes=0):
            """counted() on a new buffer made with env set (a buffer reads it when made); the
            one before is destroyed first."""
            nonlocal buf
            buf.destroy()
            os.environ.update(env)
            buf = deep_ep.Buffer(group, int(3e9), 0, explicitly_destroy=True, device="cuda",
                                 out_pool_bytes=pool_bytes)
            return counted(name)

        def restore(k, v):
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

        lres, linpl = counted("defaults")
        # The same without the spares (the outputs of the next calls made while a dispatch
        # waits for its count, epcomm._spares): what they save on the host's critical path.
        # Off, on, off, on: a loop's order of its own moves a median by more than they do.
        pairs = []
        for _ in range(2):
            buf._spares.enabled = False
            try:
                off = timed(group, layer, o.iters, "layer step, spares off", spikes)
            finally:
                buf._spares.enabled = True
            pairs.append((off, timed(group, layer, o.iters, "layer step, defaults", spikes)))
        lnospare = tuple(statistics.mean(p[0][i] for p in pairs) for i in range(3))
        # The defaults' figures: the two loops alternated with the spares off (the first loop,
        # kept for its in-place counts, runs first after the other forms and had the run's
        # first-call spikes and garbage collections in the 17th session's runs).
        lres = tuple(statistics.mean(p[1][i] for p in pairs) for i in range(3))
        pool_, buf._out_pool = buf._out_pool, None  # plain outputs, the late hello promised
        lpromise = timed(group, layer, o.iters, "layer step, pool off, late promised", spikes)
        buf._out_pool = pool_
        calls = o.iters + 10
        mp = cbuf = recv_x = recv_w = cw = handle = expert_out = plain = pool_ = None  # freed
        # The out pool without the late hello: the combine still reads recv_x in place, the
        # dispatch copies it out (what the late hello's wait costs, apart from the pool's
        # allocation, at a size where the host is the bottleneck).
        lnolate, ninpl = fresh("out pool, late hello off", {"EP_CUDA_LATE_HELLO": "0"},
                               int(1.5e9))
        # The baseline: a buffer without the out pool (nor the late hello, which needs it).
        lplain, pinpl = fresh("no out pool", {})
        restore("EP_CUDA_LATE_HELLO", late_env)
        # EP_CUDA_EARLY_DATA=1: without the out pool, then the out pool without the late hello
        # (with it the senders wait for the outputs: no early data).
        learly, _ = fresh("no out pool, early data", {"EP_CUDA_EARLY_DATA": "1"})
        lpearly, einpl = fresh("out pool, late hello off, early data",
                               {"EP_CUDA_LATE_HELLO": "0"}, int(1.5e9))
        restore("EP_CUDA_EARLY_DATA", early_env)
        restore("EP_CUDA_LATE_HELLO", late_env)
        if me == 0:
            print(f"torch {torch.__version__}; the out pool's direct calls "
                  f"{'used' if _mempool._DIRECT else 'not used (use_mem_pool)'}")
            print(f"R={R}, {o.sms} SMs per rank{' (main threads pinned)' if o.pin else ''}, "
                  f"{o.tokens} tokens per rank, H {H}, topk {TOPK}, "
                  f"E {E}, bf16; rank 0 receives {rows} rows; experts' write + combine "
                  f"({'with' if o.weights else 'without'} weights), median of the slowest rank, "
                  f"{o.iters} calls")
            base, limit = res[0][1], res[2][1]
            print(f"{'input':<16}{'us':>10}{'x tensor':>10}{'of limit':>10}  in place")
            for name, us, inpl, *_ in res:
                print(f"{name:<16}{us:10.1f}{base / us:10.2f}{limit / us:10.2f}  {inpl}/{calls}")
            print("baseline: tensor (staged); limit: combine buffer (in place, nothing "
                  "allocated)")
            print(f"dispatch with topk, num_worst_tokens={W} (outputs allocated before the call, "
                  f"no host wait), median of the slowest rank")
            print(f"{'outputs':<16}{'us':>10}{'x tensor':>10}  in place")
            for name, us, inpl, *_ in dres:
                print(f"{name:<16}{us:10.1f}{dres[0][1] / us:10.2f}  {inpl}/{calls}")
            print("baseline: tensor (rows copied out of the buffer); the limit, views of the "
                  "buffer (no copy), is not offered in Python: `epcomm bench --backend cuda` "
                  "times it")
            print(f"layer step (get_dispatch_layout + dispatch with default outputs + combine "
                  f"of its rows), the package's defaults (out pool + late hello): "
                  f"{lres[0]:.1f} us (median), {lres[1]:.1f} us (mean), two loops' means; in "
                  f"place (a loop before them): "
                  f"{linpl[0]}/{calls} dispatches, {linpl[1]}/{calls} combines")
            print(f"the same, spares off (no outputs made while the dispatch waits): "
                  f"{lnospare[0]:.1f} us (median), {lnospare[1]:.1f} us (mean), two loops' "
                  f"means; spares on x off, loops alternated (medians): " +
                  ", ".join(f"{off[0]:.1f} / {on[0]:.1f} us = {off[0] / on[0]:.2f}"
                            for off, on in pairs))
            print(f"the same, out pool off (plain outputs, late hello still promised): "
                  f"{lpromise[0]:.1f} us (median), {lpromise[1]:.1f} us (mean)")
            print(f"the same, a fresh buffer without the out pool (out_pool_bytes=0, late hello "
                  f"off; baseline): {lplain[0]:.1f} us (median), {lplain[1]:.1f} us (mean); in "
                  f"place: {pinpl[0]}/{calls} dispatches, {pinpl[1]}/{calls} combines")
            print(f"the same, out pool with the late hello off (combine in place, dispatch "
                  f"copied out): {lnolate[0]:.1f} us (median), {lnolate[1]:.1f} us (mean); in "
                  f"place: {ninpl[0]}/{calls} dispatches, {ninpl[1]}/{calls} combines")
            print(f"the same, no out pool, EP_CUDA_EARLY_DATA=1: {learly[0]:.1f} us "
                  f"(median), {learly[1]:.1f} us (mean)")
            print(f"the same, out pool, late hello off, EP_CUDA_EARLY_DATA=1: {lpearly[0]:.1f} "
                  f"us (median), {lpearly[1]:.1f} us (mean); in place: {einpl[0]}/{calls} "
                  f"dispatches, {einpl[1]}/{calls} combines")
            print(f"x baseline: defaults (out pool + late hello) {lplain[0] / lres[0]:.2f}, "
                  f"promise alone {lplain[0] / lpromise[0]:.2f}, out pool without the late hello "
                  f"{lplain[0] / lnolate[0]:.2f}, early data {lplain[0] / learly[0]:.2f}, out "
                  f"pool + early data {lplain[0] / lpearly[0]:.2f} (medians)")
            for line in spikes:
                print(f"spike: {line}")
            if o.json:
                def figure(t, inpl=None):
                    f = {"median_us": t[0], "mean_us": t[1], "rank_mean_us": t[2],
                         "calls": calls}
                    return f if inpl is None else {**f, "in_place": inpl}
                fig = {f"{what}_{name.replace(' ', '_')}": figure((us, mean, rmean), inpl)
                       for what, rows_ in (("write_combine", res), ("dispatch_worst", dres))
                       for name, us, inpl, mean, rmean in rows_}
                fig["layer_dispatch_combine"] = figure(lres, list(linpl))
                fig["layer_dispatch_combine_nospares"] = figure(lnospare)
                fig["layer_dispatch_combine_promise"] = figure(lpromise)
                fig["layer_dispatch_combine_pool_nolate"] = figure(lnolate, list(ninpl))
                fig["layer_dispatch_combine_plain"] = figure(lplain, list(pinpl))
                fig["layer_dispatch_combine_early"] = figure(learly)
                fig["layer_dispatch_combine_pool_early"] = figure(lpearly, list(einpl))
                with open(o.json, "w") as f:
                    json.dump({"ranks": R, "sms": o.sms, "tokens": o.tokens, "hidden": H,
                               "torch": torch.__version__, "pool_direct_calls": _mempool._DIRECT,
                               "weights": o.weights, "pinned": o.pin, "figures": fig,
                               "spikes": spikes}, f,
                              indent=1)
    finally:
        buf.destroy()
        group.destroy()


if __name__ == "__main__":
    main()
