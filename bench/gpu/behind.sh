#!/usr/bin/env bash
# Work left running on the GPU machine between calls, so the GPU serves while later calls carry parts: the device
# tool ends what a call leaves running unless it began a session of its own (setsid), and gives the machine back
# after 30 s without a call, so each later call carries, sets up or waits here.
#
# From the repository root, on the GPU machine:
#   bench/gpu/behind.sh start NAME LINE   # the shell LINE run detached in ~/behind/NAME/tree, a copy of this folder,
#                                         # with OUT=~/behind/NAME (visit.sh's and acceptance.sh's logs and tars)
#   bench/gpu/behind.sh wait NAME SECS    # wait up to SECS for NAME to end (show its last lines), then send
#                                         # ~/behind/NAME back as $OUT/NAME.tgz; ends 0 once NAME has ended
# A LINE that must follow another waits for it first: `until [ -f ~/behind/OTHER/rc ]; do sleep 5; done; ...`.
# The copy because each call lays the carried tree over the checkout again, which empties what a run put back there
# (the stand-in's folders, served from the tree) while it boots.
set -euo pipefail

BEHIND=$HOME/behind
say() { echo "behind: $*" >&2; }
. "$(dirname "$0")/carried.sh"

case "${1:-}" in
start)
    name=${2:-} line=${3:-}
    plain_name NAME "$name"
    [ -n "$line" ] || { say "start $name: expected the shell LINE to run"; exit 2; }
    folder=$BEHIND/$name
    rm -rf -- "$folder" && mkdir -p "$folder"
    printf '%s\n' "$line" > "$folder/line"
    cp -a . "$folder/tree"
    setsid nohup bash -c 'cd "$1/tree" && OUT=$1 bash "$1/line" > "$1/out.log" 2>&1; echo $? > "$1/rc"' _ "$folder" \
        < /dev/null > /dev/null 2>&1 &
    say "$name started"
    ;;
wait)
    name=${2:-} secs=${3:-}
    plain_name NAME "$name"
    whole_number SECS "$secs"
    folder=$BEHIND/$name
    deadline=$(( $(date +%s) + 10#$secs ))
    while [ ! -f "$folder/rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    grep -v booting "$folder/out.log" | tail -n 25 || true
    tar -czf "${OUT:-.}/$name.tgz" -C "$BEHIND" --exclude "$name/tree" "$name"
    if [ -f "$folder/rc" ]; then say "$name ended: exit $(cat "$folder/rc")"; else say "$name still running"; exit 3; fi
    ;;
*)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
