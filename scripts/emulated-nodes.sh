#!/usr/bin/env bash
# Run a ringzero command on two emulated nodes: two network namespaces joined by a veth pair whose
# each direction `tc tbf` limits to RATE (a node's network link), half the ranks in each, shm
# between the ranks of one namespace (they share /dev/shm; RINGZERO_NODE_ID tells the nodes
# apart), tcp over the limited link between them. Needs root (ip netns, tc); it only uses the
# private addresses of the namespaces it makes and removes them when it ends.
#
#   sudo scripts/emulated-nodes.sh [-n RANKS] [-r RATE] -- bench all-gather-v --algos ring,doubling
#
# RANKS (default 8, even) ranks of `target/release/ringzero ARGS...`; rank 0's output is printed,
# every rank's is kept in $LOGS (default a temporary directory). RATE is a tc rate (default
# 2gbit). Every rank runs under `timeout` (LIMIT seconds, default 300).
set -euo pipefail

ranks=8
rate=2gbit
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) ranks="$2"; shift 2 ;;
    -r) rate="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-n RANKS] [-r RATE] -- RINGZERO_ARGS..." >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "$0: no ringzero command given (after --)" >&2; exit 2
fi
if (( ranks < 2 || ranks % 2 )); then
  echo "$0: -n must be an even number of ranks, at least 2 (got $ranks)" >&2; exit 2
fi
bin="$(cd "$(dirname "$0")/.." && pwd)/target/release/ringzero"
[[ -x "$bin" ]] || { echo "$0: $bin not built (cargo build --release)" >&2; exit 2; }
logs="${LOGS:-$(mktemp -d)}"
limit="${LIMIT:-300}"
tag="rz$$"
ns=("${tag}a" "${tag}b")
addr=(10.77.0.1 10.77.0.2)

cleanup() {
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT

for i in 0 1; do ip netns add "${ns[$i]}"; done
ip link add "${tag}v0" type veth peer name "${tag}v1"
for i in 0 1; do
  ip link set "${tag}v$i" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${addr[$i]}/24" dev "${tag}v$i"
  ip -n "${ns[$i]}" link set lo up
  ip -n "${ns[$i]}" link set "${tag}v$i" up
  tc -n "${ns[$i]}" qdisc add dev "${tag}v$i" root tbf rate "$rate" burst 256kb latency 20ms
done

half=$(( ranks / 2 ))
port=$(( 20000 + $$ % 20000 ))
pids=()
for (( r = 0; r < ranks; r++ )); do
  node=$(( r / half ))
  env RINGZERO_RANK="$r" RINGZERO_WORLD_SIZE="$ranks" \
    RINGZERO_LOCAL_RANK=$(( r % half )) RINGZERO_LOCAL_WORLD_SIZE="$half" \
    RINGZERO_MASTER_ADDR="${addr[0]}" RINGZERO_MASTER_PORT="$port" \
    RINGZERO_SECRET="$tag-secret" RINGZERO_JOB_ID="$tag" RINGZERO_NODE_ID="emulated-node-$node" \
    timeout "$limit" ip netns exec "${ns[$node]}" "$bin" "$@" > "$logs/rank-$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
cat "$logs/rank-0.log"
echo "# emulated nodes: $ranks ranks on 2 namespaces, link $rate each way; logs in $logs; exit $rc"
exit "$rc"
