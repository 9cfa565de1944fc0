# Sourced by the scripts: what Open MPI needs on a workstation or in a container.
#  - running as root is refused unless both variables below are set;
#  - more ranks than cores is refused unless oversubscription is allowed;
#  - the CMA single-copy path of the shared-memory transport fails in most containers.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
