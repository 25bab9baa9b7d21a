/* `epcomm launch --hosts H`: pretend hosts on one machine. Between hosts only the network
 * engine moves data, and the engine is MPI, whose ranks only an MPI launcher can start (MPI
 * processes started otherwise are singletons that cannot see each other). So the launcher
 * becomes mpirun, with what makes it behave on one machine: --oversubscribe (more ranks than
 * cores), --bind-to none (ranks float, as under `epcomm launch`), the shared-memory transport,
 * and EP_HOSTS=H in the ranks' environment. The library reads EP_HOSTS; nothing else differs. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch.h"
#include "tk_spawn.h"

int launch_exec_mpirun(const struct launch *l) {
  char mpirun[4096], nr[16], hosts[16], tmo[32];
  if (!tk_find_exe("mpirun", 0, mpirun, sizeof mpirun)) {
    fprintf(stderr,
            "epcomm launch: --hosts needs mpirun on PATH (the hosts talk through MPI; "
            "install Open MPI: openmpi-bin)\n");
    return EXIT_USAGE;
  }
  snprintf(nr, sizeof nr, "%d", l->nranks);
  snprintf(hosts, sizeof hosts, "%d", l->hosts);
  setenv("EP_HOSTS", hosts, 1);
  if (geteuid() == 0) { /* Open MPI refuses root without these; containers run as root */
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  int n = 0, nprog = 0;
  while (l->prog[nprog]) nprog++;
  char **argv = calloc((size_t)nprog + 20, sizeof *argv);
  if (!argv) return EXIT_INTERNAL;
  argv[n++] = mpirun, argv[n++] = "-n", argv[n++] = nr;
  argv[n++] = "--oversubscribe", argv[n++] = "--bind-to", argv[n++] = "none";
  if (!getenv("OMPI_MCA_btl")) argv[n++] = "--mca", argv[n++] = "btl", argv[n++] = "self,vader";
  if (tk_mpirun_needs_agent()) /* pretend hosts are all this one */
    argv[n++] = "--mca", argv[n++] = "plm_rsh_agent", argv[n++] = "false";
  if (l->tag) argv[n++] = "--tag-output";
  if (l->timeout > 0) {
    snprintf(tmo, sizeof tmo, "%.0f", l->timeout < 1 ? 1 : l->timeout);
    argv[n++] = "--timeout", argv[n++] = tmo;
  }
  for (int i = 0; i < nprog; i++) argv[n++] = l->prog[i];
  fflush(stdout);
  execv(mpirun, argv);
  fprintf(stderr, "epcomm launch: cannot run %s: %s\n", mpirun, strerror(errno));
  free(argv);
  return EXIT_INTERNAL;
}
