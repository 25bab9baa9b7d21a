/* The EP_* variables the core reads (logging, deadlines, buffer defaults, bootstrap). The rows
 * of the backends live with them (src/cpu/cpu_env.c, src/cuda/cuda_env.c); src/core/env.c holds
 * the registry that lists them all. */
#include "backend.h"

static const ep_env_row_t core_rows[] = {
    EP_ENV_ROW_ENUM("core", "EP_LOG", "warn", "none|warn|info|debug|trace",
                    "log level of the library's messages"),
    EP_ENV_ROW_TEXT("core", "EP_LOG_FILE", "path", "a file name",
                    "append log lines to this file instead of stderr"),
    EP_ENV_ROW_FLOAT("core", "EP_TIMEOUT_S", "100", "0", "1e9",
                     "deadline in seconds of every wait inside a call (a config's timeout_s "
                     "overrides)"),
    EP_ENV_ROW_FLOAT("core", "EP_HEARTBEAT_S", "5", "-1", "1e9",
                     "across hosts: a rank of the next host silent this long is reported dead "
                     "(its host is down); each rank sends beats 8 times as often from a thread "
                     "of the group (MPI_THREAD_MULTIPLE only); 0 or less: off"),
    EP_ENV_ROW_ENUM("core", "EP_BACKEND", "cpu", "cpu|cuda",
                    "backend of buffers whose config says EP_BACKEND_AUTO"),
    EP_ENV_ROW_SIZE("core", "EP_QUEUE_BYTES", "1M", "4K", "16G",
                    "bytes of each per-(peer, channel) normal-mode queue (config queue_bytes "
                    "overrides)"),
    EP_ENV_ROW_INT("core", "EP_CHANNELS", "1", "1", "64",
                   "channels per rank (cpu: worker threads; config num_channels overrides)"),
    EP_ENV_ROW_INT("core", "EP_RANK", "", "0", "16777215",
                   "this process's rank (set by epcomm launch)"),
    EP_ENV_ROW_INT("core", "EP_NRANKS", "", "1", "16777216",
                   "number of ranks of the job (set by epcomm launch)"),
    EP_ENV_ROW_INT("core", "EP_LOCAL_SIZE", "", "1", "16777216",
                   "ranks on this host (set by epcomm launch for the program; the library "
                   "itself does not need it)"),
    EP_ENV_ROW_TEXT("core", "EP_JOB_ID", "string", "any text",
                    "rendezvous name shared by the ranks of one job (set by epcomm launch)"),
    EP_ENV_ROW_TEXT("core", "EP_JOB_SECRET", "secret", "any text (never shown)",
                    "shared by the ranks of one job and proven when they connect (set by epcomm "
                    "launch; without it: derived from the job's ids)"),
    EP_ENV_ROW_INT("core", "EP_NOTIFY_FD", "", "0", "1048576",
                   "socket on which epcomm launch reports dead ranks (set by epcomm launch)"),
};

EP_ENV_MODULE(core, core_rows);
