/* The EP_* variables of the network layer: how ranks are split into hosts, and which libraries
 * the engines load. src/core/env.c lists them with every other module's. */
#include "core/backend.h"

static const ep_env_row_t net_rows[] = {
    EP_ENV_ROW_INT("net", "EP_HOSTS", "1", "1", "4096",
                   "split the job's consecutive ranks into this many pretend hosts (tests, "
                   "benchmarks: between them only the network engine is used); must divide the "
                   "number of ranks; needs the ranks started by mpirun or `epcomm launch --hosts`"),
    EP_ENV_ROW_TEXT("net", "EP_HOST_ID", "string", "any text (one value per host)",
                    "this rank's host, overriding the machine it runs on (ranks with the same "
                    "value form one host and must run on one machine); set on every rank or none"),
    EP_ENV_ROW_TEXT("net", "EP_MPI_LIB", "path", "a library path or name",
                    "the MPI library the MPI engine loads (default: libmpi.so.40, Open MPI's ABI)"),
    EP_ENV_ROW_TEXT("net", "EP_NCCL_LIB", "path", "a library path or name",
                    "the NCCL library the NCCL engine loads (default: libnccl.so.2)"),
    EP_ENV_ROW_SIZE("net", "EP_NET_CHUNK", "1M", "4K", "1G",
                    "bytes of one network transfer of normal mode: a larger block goes in "
                    "several, so that forwarding starts before the whole block has arrived"),
};

EP_ENV_MODULE(net, net_rows);
