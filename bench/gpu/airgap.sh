#!/usr/bin/env bash
# The cuda image on a GPU host with no network (and no Docker of its own), through the project's own commands: the
# engine from the kit's Debian packages (`make engine`), the GPU by its device nodes where the host has no NVIDIA
# toolkit (compose.gpu-devices.yaml, chosen by `doctor`'s rule), then `python3 build.py COMMAND --target cuda ...`.
# The parts come from `python bench/gpu/pack.py PARTS_DIR` on a machine with a network (docs/gpu/README.md).
#
# From the repository root, on the GPU host:
#   bench/gpu/airgap.sh setup PARTS_DIR [--follow SECONDS]
#                                          # every part checked against SHA256SUMS (a part it does not name is
#                                          # refused), the host tool in .venv, the engine, the image loaded (its ID
#                                          # checked against IMAGE), the kit's models unpacked, then `doctor`; with
#                                          # --follow, while the parts are still arriving (each renamed into PARTS_DIR
#                                          # whole): each is checked and used as it comes, in SHA256SUMS' order, and
#                                          # setup gives up after SECONDS without the next
#   bench/gpu/airgap.sh update PARTS_DIR   # an update packed with `pack.py --on-top-of`: its parts checked, the image
#                                          # it sits on checked present, its new layers loaded (its ID checked)
#   bench/gpu/airgap.sh run COMMAND ARGS   # python3 build.py COMMAND --target cuda ARGS (run, sweep, up, smoke...),
#                                          # serving the kit's --model/--drafter where it has them, else the checkout's
#                                          # stand-in (images.yaml models.qwen35-mini), or MODEL_DIR and DRAFTER_DIR
#                                          # where set (`run stand-in` writes the 27B's layout); reports in reports/
# SERVEKIT_KIT names where the kit is unpacked (default ~/servekit-kit); SERVEKIT_DRIVER_DIR the driver's folder,
# whose lib64/ gives the host tool NVML where the system's library path does not (default /usr/local/nvidia).
set -euo pipefail

say() { echo "airgap: $*" >&2; }
usage() { sed -n '2,20p' "$0" >&2; exit 2; }

KIT=${SERVEKIT_KIT:-$HOME/servekit-kit}
KIT=${KIT%/}
[[ -n $KIT && $KIT != "$HOME" && $KIT != / ]] || { say "SERVEKIT_KIT '$KIT': expected a folder of its own"; exit 2; }
DRIVER_LIB=${SERVEKIT_DRIVER_DIR:-/usr/local/nvidia}/lib64
[ -d "$DRIVER_LIB" ] && export LD_LIBRARY_PATH=$DRIVER_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# named NAME SUMS: the line of SUMS that names NAME exactly (as sha256sum writes it, text or binary mode), or nothing.
named() { awk -v n="$1" '$2 == n || $2 == "*" n' "$2"; }

# checked DIR: every part SHA256SUMS names matches, and every file of DIR but SHA256SUMS and IMAGE is named in it
# (a part nobody checked is never used).
checked() {
    local dir=$1 file name
    [ -f "$dir/SHA256SUMS" ] && [ -f "$dir/IMAGE" ] || { say "$dir: no SHA256SUMS and IMAGE: not a folder of parts"; exit 1; }
    for file in "$dir"/*; do
        name=${file##*/}
        [[ $name == SHA256SUMS || $name == IMAGE || $name == LAYERS || $name == ON-TOP-OF ]] && continue
        [ -f "$file" ] && [ -n "$(named "$name" "$dir/SHA256SUMS")" ] ||
            { say "$file: not named in SHA256SUMS, so never checked; remove it or pack again"; exit 1; }
    done
    (cd "$dir" && sha256sum --check --quiet SHA256SUMS) || { say "$dir: a part is damaged (above); copy it again"; exit 1; }
    say "$(wc -l < "$dir/SHA256SUMS") parts checked"
}

# parts_named DIR PREFIX: the names SHA256SUMS gives the parts that start with PREFIX, in its order (pack's).
parts_named() { awk -v p="$2" '{ n = $2; sub(/^\*/, "", n) } index(n, p) == 1 { print n }' "$1/SHA256SUMS"; }

FOLLOW=0
last_arrival=$SECONDS

# present DIR NAME: wait until NAME is in DIR, giving up FOLLOW s after the last part came.
present() {
    local dir=$1 name=$2
    [ -f "$dir/$name" ] || say "waiting for $name"
    until [ -f "$dir/$name" ]; do
        (( SECONDS - last_arrival < FOLLOW )) || { say "$dir/$name: not there after $FOLLOW s; copy it and run setup again"; exit 1; }
        sleep 1
    done
    last_arrival=$SECONDS
}

# arrived DIR NAME: with FOLLOW seconds, NAME once present, checked against SHA256SUMS; without, it was checked with
# the others before anything was used.
arrived() {
    local dir=$1 name=$2
    (( FOLLOW > 0 )) || return 0
    present "$dir" "$name"
    (cd "$dir" && named "$name" SHA256SUMS | sha256sum --check --quiet) || { say "$dir/$name: damaged; copy it again"; exit 1; }
}

# stream DIR PREFIX: the parts that start with PREFIX, each as it arrives, joined (the wait counted from its start:
# it runs in a pipeline's subshell).
stream() {
    local name
    last_arrival=$SECONDS
    for name in $(parts_named "$1" "$2"); do
        arrived "$1" "$name"
        cat -- "$1/$name"
    done
}

case "${1:-}" in
setup)
    { [ $# -eq 2 ] || { [ $# -eq 4 ] && [ "$3" = --follow ]; }; } && [ -d "$2" ] ||
        { say "setup: expected the folder of parts"; usage; }
    [ $# -eq 2 ] || [[ $4 =~ ^[1-9][0-9]*$ ]] || { say "setup: --follow $4: expected a whole number of seconds"; exit 2; }
    parts=$(cd "$2" && pwd)
    started=$(date +%s)
    if [ $# -eq 4 ]; then
        FOLLOW=$4
        present "$parts" SHA256SUMS
        present "$parts" IMAGE
    else
        checked "$parts"
    fi
    rm -rf -- "$KIT" && mkdir -p "$KIT" && stream "$parts" kit- | tar -x -C "$KIT"
    python3 -m venv --without-pip .venv
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$KIT"/kit/wheels/*.whl
    pwd > "$site/servekit-checkout.pth"  # what `pip install -e .` does, without pip's build backend
    touch .venv/.installed
    SERVEKIT_ENGINE_PACKAGES=$KIT/kit/engine .venv/bin/python build.py engine
    read -r tag image_id < "$parts/IMAGE"
    stream "$parts" image- | LD_LIBRARY_PATH=$KIT/kit/tools "$KIT/kit/tools/zstd" -d -c | docker load
    loaded=$(docker image inspect --format '{{.Id}}' "$tag")
    [ "$loaded" = "$image_id" ] || { say "$tag loaded as $loaded, not the packed $image_id"; exit 1; }
    [ -d "$KIT/kit/models" ] && chmod -R a+rX "$KIT/kit/models"  # the image's user reads them
    .venv/bin/python build.py doctor || true
    say "ready in $(( $(date +%s) - started )) s: $tag ($image_id)"
    ;;
update)
    [ $# -eq 2 ] && [ -d "$2" ] && [ -f "$2/ON-TOP-OF" ] || { say "update: expected a folder packed with --on-top-of"; usage; }
    started=$(date +%s)
    checked "$2"
    read -r base < "$2/ON-TOP-OF"
    docker image inspect "$base" > /dev/null 2>&1 ||
        { say "update: this host lacks image $base, which the update sits on: set up its full pack first"; exit 1; }
    read -r tag image_id < "$2/IMAGE"
    zstd=zstd
    [ -x "$KIT/kit/tools/zstd" ] && zstd=$KIT/kit/tools/zstd
    cat "$2"/image-* | LD_LIBRARY_PATH=$KIT/kit/tools "$zstd" -d -c | docker load
    loaded=$(docker image inspect --format '{{.Id}}' "$tag")
    [ "$loaded" = "$image_id" ] || { say "$tag loaded as $loaded, not the packed $image_id"; exit 1; }
    say "updated in $(( $(date +%s) - started )) s: $tag ($image_id), on top of $base"
    ;;
run)
    [ $# -ge 2 ] || { say "run: expected a command of build.py, e.g. run --profile default"; usage; }
    command=$2
    shift 2
    model=$PWD/bench/gpu/qwen35-mini drafter=$PWD/bench/gpu/qwen35-mini-dflash2  # the stand-in and its drafter
    if [ -n "${MODEL_DIR:-}" ]; then
        model=$MODEL_DIR drafter=${DRAFTER_DIR:-}  # yours, e.g. what `run stand-in` wrote (.cache/stand-in)
    elif [ -d "$KIT/kit/models/model" ]; then
        model=$KIT/kit/models/model drafter=$KIT/kit/models/drafter  # the kit's; its drafter only if it carries one
    fi
    [ -d "$drafter" ] || drafter=
    chmod -R a+rX "$model" ${drafter:+"$drafter"}  # the image's user reads them
    MODEL_DIR=$model DRAFTER_DIR=$drafter exec .venv/bin/python build.py "$command" --target cuda "$@"
    ;;
*)
    usage
    ;;
esac
