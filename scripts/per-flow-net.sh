#!/usr/bin/env bash
# Run a command in a network namespace whose loopback holds every TCP flow to RATE, as a per-flow
# limit does on real networks (a NIC's per-queue pacing, ECMP hashing one flow onto one path, a
# window against a long round trip, one core's worth of receive processing). The namespace's
# loopback is the only network the command sees.
#
#   scripts/per-flow-net.sh RATE -- COMMAND [ARGS...]
#   scripts/per-flow-net.sh 800mbit -- target/release/ringzero bench all-reduce -n 2 --transport tcp --tcp-sockets 4
#
# How: an htb qdisc on the namespace's `lo` with 256 classes of RATE each; a u32 filter hashes each
# TCP packet's source port (its low byte) into one of them. A flow's data packets all carry the
# sending side's port, so each flow gets one class; two flows whose ports share a low byte share
# one (likely for a few flows in 256, so compare runs, not single figures). Needs root, `ip` and
# `tc` (htb and u32 are in most kernels; fq and netem are not needed). The namespace is removed
# on exit.
set -euo pipefail

if [[ $# -lt 3 || $2 != "--" ]]; then
    echo "usage: $0 RATE -- COMMAND [ARGS...]   (RATE as tc reads it: 800mbit, 2gbit)" >&2
    exit 2
fi
rate=$1
shift 2
if [[ $(id -u) -ne 0 ]]; then
    echo "$0: needs root (it creates a network namespace and a qdisc)" >&2
    exit 2
fi
for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "$0: \`$tool\` not found (iproute2)" >&2; exit 2; }
done

ns="ringzero-flows-$$"
ip netns add "$ns"
trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
run() { ip netns exec "$ns" "$@"; }
run ip link set lo up
run tc qdisc add dev lo root handle 1: htb default 1
run tc class add dev lo parent 1: classid 1:1 htb rate 100gbit quantum 200000
batch=$(mktemp)
for i in $(seq 0 255); do
    printf 'class add dev lo parent 1: classid 1:%x htb rate %s burst 256k cburst 256k quantum 65536\n' \
        $((i + 256)) "$rate"
done >"$batch"
echo "filter add dev lo parent 1:0 prio 1 handle 2: protocol ip u32 divisor 256" >>"$batch"
echo "filter add dev lo parent 1:0 prio 1 protocol ip u32 ht 800:: match ip protocol 6 0xff hashkey mask 0x00ff0000 at 20 link 2:" >>"$batch"
for i in $(seq 0 255); do
    printf 'filter add dev lo parent 1:0 prio 1 protocol ip u32 ht 2:%x: match u8 0 0 flowid 1:%x\n' \
        "$i" $((i + 256))
done >>"$batch"
run tc -batch "$batch"
rm -f "$batch"
echo "# per-flow-net: every TCP flow in namespace $ns held to $rate" >&2
run "$@"
