#!/usr/bin/env bash
# Runs tests/test_mpi_bootstrap under mpirun (3 ranks): a group built from MPI's collectives.
# Usage: tests/test_mpi_bootstrap.sh BUILD_DIR
set -u
b=${1:?usage: test_mpi_bootstrap.sh BUILD_DIR}
prog=$b/tests/test_mpi_bootstrap
[ -x "$prog" ] || { echo "skipped: built without MPI (or in the sanitizer build)"; exit 77; }
command -v mpirun >/dev/null || { echo "skipped: no mpirun"; exit 77; }
# Root in CI containers: OpenMPI refuses root unless told; shared memory between the ranks.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
timeout 60 mpirun -n 3 --oversubscribe --bind-to none --mca btl self,vader "$prog" || exit 1
# Across (pretend) hosts, with the MPI the program initialized: epcomm must leave it alone.
timeout 60 mpirun -n 4 --oversubscribe --bind-to none --mca btl self,vader -x EP_HOSTS=2 "$prog"
