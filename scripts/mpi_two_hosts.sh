#!/usr/bin/env bash
# Two "hosts" on one machine: tensor parallelism across machines, rehearsed. Two network
# namespaces (h0, h1) joined by a veth pair (10.77.0.1 <-> 10.77.0.2), each with a hostname of its
# own (a UTS namespace), so Open MPI sees two nodes and its ranks talk TCP over the veth pair, as
# two machines on a network would. mpirun runs on h0 and starts h1's daemon (orted) through
# `ip netns exec` where a cluster would use ssh (the plm_rsh_agent below). Root only.
#
#   scripts/mpi_two_hosts.sh [MODEL] [PROMPT]     (default: stories260K converted into build/)
#
# Prints rank 0's greedy text across the two hosts and the same ranks in one process, and fails
# when they differ; then llmq-bench's all-reduce across the veth pair. Removes the namespaces at
# the end.
set -euo pipefail
cd "$(dirname "$0")/.."
# Exit 77 (CTest's "skipped") where the machine cannot make network namespaces: not root, no
# iproute2 or unshare, or a container that forbids them.
skip() { echo "SKIPPED: mpi_two_hosts.sh: $*" >&2; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (ip netns)"
command -v ip >/dev/null && command -v unshare >/dev/null || skip "needs ip (iproute2) and unshare (util-linux)"
command -v mpirun >/dev/null || skip "needs mpirun (openmpi-bin)"
ip netns add llmq-probe 2>/dev/null && ip netns del llmq-probe || skip "this machine does not allow network namespaces"
B=${BUILD_DIR:-$PWD/build}
model=${1:-}
prompt=${2:-Once upon a time}
ns_down() {
  ip netns del llmq-h0 2>/dev/null || true
  ip netns del llmq-h1 2>/dev/null || true
  rm -rf /etc/netns/llmq-h0 /etc/netns/llmq-h1
}
ns_down  # a run that was killed may have left them
work=$(mktemp -d /tmp/llmq-2hosts.XXXXXX)
trap 'ns_down; rm -rf "$work"' EXIT
if [ -z "$model" ]; then
  model=$work/stories260K.llmq
  "$B/llmq-convert" ../shared/models/stories260K/stories260K.bin --tokenizer ../shared/models/stories260K/tok512.bin --type f32 -o "$model" -f >/dev/null
fi

# The network: h0 10.77.0.1/24 -- veth -- h1 10.77.0.2/24; names in each namespace's /etc/hosts
# (ip netns exec mounts /etc/netns/NAME/hosts over /etc/hosts).
for h in 0 1; do
  ip netns add llmq-h$h
  ip -n llmq-h$h link set lo up
  mkdir -p /etc/netns/llmq-h$h
  printf '127.0.0.1 localhost\n10.77.0.1 h0\n10.77.0.2 h1\n' >/etc/netns/llmq-h$h/hosts
done
ip link add llmq-veth0 netns llmq-h0 type veth peer name llmq-veth1 netns llmq-h1
ip -n llmq-h0 addr add 10.77.0.1/24 dev llmq-veth0
ip -n llmq-h1 addr add 10.77.0.2/24 dev llmq-veth1
ip -n llmq-h0 link set llmq-veth0 up
ip -n llmq-h1 link set llmq-veth1 up

# "ssh HOST CMD...": runs CMD in HOST's namespace under HOST's name (what mpirun's rsh launcher calls).
cat >"$work/ns-ssh" <<'EOF'
#!/bin/bash
host=$1; shift
# as ssh does, the remote command is one shell line (mpirun passes it in pieces)
exec ip netns exec "llmq-$host" unshare --uts /bin/bash -c "hostname $host; $*"
EOF
chmod +x "$work/ns-ssh"
printf 'h0 slots=1\nh1 slots=1\n' >"$work/hostfile"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# --bind-to none: both "hosts" are this machine, and mpirun would bind each one's rank to core 0
# (the same core: 4 ms a collective, a scheduler tick, while the other spins on it).
mpi=(mpirun --hostfile "$work/hostfile" -np 2 --bind-to none --mca plm_rsh_agent "$work/ns-ssh"
     --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24)
on_h0() { ip netns exec llmq-h0 unshare --uts /bin/bash -c 'hostname h0; exec "$@"' h0 "$@"; }

echo "== mpirun across h0 and h1: ${mpi[*]} $B/llmq-run -m $model --tp 2 -t 1 ..."
on_h0 "${mpi[@]}" "$B/llmq-run" -m "$model" -p "$prompt" -n 48 --temp 0 --tp 2 -t 1 >"$work/two.txt"
on_h0 "${mpi[@]}" --tag-output hostname
"$B/llmq-run" -m "$model" -p "$prompt" -n 48 --temp 0 --tp 2 -t 2 >"$work/one.txt" 2>/dev/null
cat "$work/two.txt"; echo
if cmp -s "$work/one.txt" "$work/two.txt"; then echo "== same text as the two ranks in one process"; else echo "== the texts differ" >&2; exit 1; fi
echo "== all-reduce across the veth pair (llmq-bench's all_reduce: bytes, iters, latency_us, algbw, busbw)"
on_h0 "${mpi[@]}" "$B/llmq-bench" -m "$model" -t 1 --tp 2 -p 16 -n 4 -r 1 --bandwidth-mib 0 --no-baseline 2>/dev/null |
  python3 -c 'import json, sys
for a in json.load(sys.stdin)["all_reduce"]:
    print("%d,%d,%.1f,%.3f,%.3f" % (a["bytes"], a["iters"], a["latency_us"], a["algbw_gb_s"], a["busbw_gb_s"]))'
