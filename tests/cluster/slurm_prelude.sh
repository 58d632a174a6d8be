# Sourced by the Slurm tests after they set source_dir and scratch: skips (77) without root or without the tools
# named in slurm_tools (plus munged, slurmctld, slurmd), makes the scratch folder, starts a one-node Slurm in it
# (slurm_cluster.sh), exports SLURM_CONF, and stops the cluster when the test exits.
[ "$(id -u)" = 0 ] || { echo "skipped: the one-node Slurm runs its daemons as root"; exit 77; }
for tool in munged slurmctld slurmd $slurm_tools; do
  command -v $tool >/dev/null || { echo "skipped: $tool not found (apt-get install slurm-wlm munge)"; exit 77; }
done
rm -rf "$scratch" && mkdir -p "$scratch"
cluster="$scratch/cluster"
SLURM_CONF=$(bash "$source_dir/tests/cluster/slurm_cluster.sh" start "$cluster") || exit 1
export SLURM_CONF
trap 'bash "$source_dir/tests/cluster/slurm_cluster.sh" stop "$cluster"' EXIT
fail() { echo "FAILED: $1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
