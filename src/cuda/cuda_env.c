/* The EP_* variables the CUDA backend reads. Compiled into every build, with or without CUDA,
 * so that `epcomm info` and `epcomm doctor env` know them everywhere; it needs no CUDA header. */
#include "core/backend.h"

static const ep_env_row_t cuda_rows[] = {
    EP_ENV_ROW_INT("cuda", "EP_CUDA_DEVICE", "", "0", "1023",
                   "CUDA device of this rank (config cuda_device overrides; default: "
                   "EP_LOCAL_RANK modulo the visible devices)"),
    EP_ENV_ROW_INT("cuda", "EP_LOCAL_RANK", "", "0", "16777215",
                   "rank on this host, picks the CUDA device (set by epcomm launch)"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_SMS", "0", "0", "1024",
                   "blocks (SMs) per rank of the CUDA kernels; 0: 24 in normal mode, the "
                   "rank's share of the GPU in low-latency mode (config num_sms overrides); "
                   "never more than the GPU's SMs shared among its ranks"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_ARENA_MB", "64", "1", "1048576",
                   "device memory per CUDA buffer for dispatch handles, MiB"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_LL_ASYNC", "0", "0", "1",
                   "1: low-latency calls never wait on the host for their verdict (as in a "
                   "graph capture: a failure is returned by the next call, counts are -1)"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_TRACE", "0", "0", "1",
                   "1: time the phases of normal-mode calls on the GPU (%globaltimer: count "
                   "exchange plan, hello, wait for peers; the data kernel's blocks' start "
                   "spread, its first and last block's own rows, the peers', the rest; the idle "
                   "time before each call) and print their means and medians "
                   "per kind of call on stderr when the buffer is destroyed"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_LL_OPT", "31", "0", "31",
                   "low-latency kernel variants, a bit mask (same results, for timing them): "
                   "1 parallel gate numbering, 2 fp8 cast once per token during the gate, 4 "
                   "combine metadata precomputed, 8 flags raised in parallel, 16 one kernel for "
                   "a one-phase combine"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_LL_HOOK_STREAM", "0", "0", "2",
                   "1: the send part of a two-phase low-latency call runs on the buffer's own "
                   "stream at the highest priority, beside the kernels the caller queues before "
                   "ep_ll_recv (its inputs must stay unchanged until then); 2: the same at the "
                   "default priority; 0 (default; measured faster on one GPU): on the caller's "
                   "stream, before them"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_LATE_HELLO", "1", "0", "1",
                   "1 (default): a normal-mode dispatch with an allocator (EP_OUTPUT_ALLOC) on "
                   "a rank that has registered memory posts a late hello once the outputs "
                   "exist, so that the senders write recv_x straight into it when it is "
                   "registered (no copy-out pass; 1.7-2.0x at 4096 tokens on an H100); 0: the "
                   "receiver copies the rows out"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_PULL", "1", "0", "1",
                   "1 (default): when every rank of a normal-mode dispatch copies out into "
                   "unregistered arrays and everything fits the receive areas at once, each "
                   "rank stages its tokens once in its own area and the receivers copy their "
                   "rows from there (one pass over the tokens instead of one over the received "
                   "rows; 1.25-1.42x at 4096 tokens on an H100); 0: the senders write every row "
                   "into the receiver's area"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_EARLY_DATA", "0", "0", "1",
                   "1: a normal-mode dispatch with an allocator (EP_OUTPUT_ALLOC) and no late "
                   "hello moves its rows into the receive areas while the host waits for the "
                   "count and allocates, then copies them out in a second kernel (when every "
                   "rank's rows fit its area at once; else the second kernel does it all); 0 "
                   "(default: on an H200 within the noise of a Python layer step at 128 "
                   "tokens, 1.14x at R = 2 with a C allocator): one data kernel after the "
                   "allocation"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_COMBINE_COPY", "1", "0", "1",
                   "1 (default): a normal-mode combine whose x the peers cannot read where it "
                   "lies (not a dispatch view, the combine buffer or registered memory) copies "
                   "it into the combine buffer with cudaMemcpyAsync first, when it fits, and "
                   "the peers read it there; 0: the combine kernel stages it on the rank's SMs"),
    EP_ENV_ROW_ENUM("cuda", "EP_CUDA_SCOPE", "auto", "auto|sys",
                    "auto (default): when every rank of a buffer runs on one GPU (ranks sharing "
                    "it under MPS), the normal-mode kernels order their flags between ranks at "
                    "the GPU's scope (2-12% faster calls at 128 tokens on an H100), else at the "
                    "system's; sys: always the system's, as for ranks on other GPUs"),
    EP_ENV_ROW_ENUM("cuda", "EP_CUDA_L2_HINT", "auto", "auto|on|off",
                    "auto (default): a normal-mode dispatch or combine whose rows, over all "
                    "ranks, come to a fifth of the GPU's L2 cache and more reads and writes "
                    "them (and a full dispatch's ids and weights) at evict-first priority in "
                    "L2 (up to 14% faster calls on an H100; ~3% slower below that size); on: "
                    "every call; off: none"),
    EP_ENV_ROW_INT("cuda", "EP_CUDA_LL_TRACE", "0", "0", "1",
                   "1: time the phases of the low-latency kernels on the GPU (%globaltimer) "
                   "and print their means on stderr when the buffer is destroyed"),
};

EP_ENV_MODULE(cuda, cuda_rows);
