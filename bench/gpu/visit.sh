#!/usr/bin/env bash
# The cuda image on a GPU machine that has no Docker and no network, through the project's own
# commands: `make engine` from carried Debian packages, the GPU by its device nodes (compose.gpu-devices.yaml),
# `python build.py run --target cuda` per profile. Parts come from `python bench/gpu/pack.py PARTS` here.
#
# From the repository root, on the GPU machine:
#   bench/gpu/visit.sh take DIR...     # copy carried parts into ~/kit-parts, each checked against SHA256SUMS
#   bench/gpu/visit.sh setup           # all parts checked; host tool, engine, image loaded
#   bench/gpu/visit.sh run LABEL ARGS  # python build.py ARGS (run or sweep); reports tarred to $OUT/LABEL.tar,
#                                      # the server's log to $OUT/LABEL-server.log
#                                      # (give `run` a --timeout inside the call's limit: a boot past it is reported)
# Runs serve qwen35-mini (images.yaml; bench/gpu/qwen35_mini.py trains it) and its DFlash2 drafter through
# MODEL_DIR and DRAFTER_DIR: the 27B cannot be fetched there.
set -euo pipefail

PARTS=${SERVEKIT_GPU_PARTS:-$HOME/kit-parts}
KIT=$HOME/kit
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # NVML for the host tool
say() { echo "visit: $*" >&2; }
. "$(dirname "$0")/carried.sh"

case "${1:-}" in
take)
    shift
    keep
    take_parts "$PARTS" "$@"
    ;;
setup)
    started=$(date +%s)
    (cd "$PARTS" && sha256sum --check --quiet SHA256SUMS)
    only_named "$PARTS" IMAGE
    say "$(wc -l < "$PARTS/SHA256SUMS") parts checked"
    rm -rf -- "$KIT" && cat "$PARTS"/kit-* | tar -x -C "$HOME"
    python3 -m venv --without-pip .venv
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$KIT"/wheels/*.whl
    pwd > "$site/servekit-checkout.pth"  # what `pip install -e .` would do, without pip's build backend
    touch .venv/.installed
    export SERVEKIT_ENGINE_PACKAGES=$KIT/engine
    if command -v make >/dev/null; then make engine; else .venv/bin/python build.py engine; fi
    read -r tag image_id < "$PARTS/IMAGE"
    cat "$PARTS"/image-* | LD_LIBRARY_PATH=$KIT/tools "$KIT/tools/zstd" -d -c | docker load  # one stream, split
    [ "$(docker image inspect --format '{{.Id}}' "$tag")" = "$image_id" ] || { say "loaded image ID differs"; exit 1; }
    restore
    chmod -R a+rX "$MODEL" "$DRAFTER"  # the image's user (10001) reads them
    .venv/bin/python build.py doctor || true
    say "ready in $(( $(date +%s) - started )) s: $tag ($image_id)"
    ;;
run)
    label=${2:-}
    plain_name LABEL "$label"
    shift 2
    restore
    mkdir -p reports
    before=$(ls reports)
    rc=0
    command=$1
    shift  # the host is native unless ARGS name another (a later --host wins)
    # The server's own log beside the reports: a check's one-line reason leaves out what a fix needs (the compile
    # key --jit-monitor-verbose prints, a traceback's frames). Each container is followed to its end (a sweep boots
    # several: the last one's log stays).
    follow() {
        local seen=" " c
        while sleep 1; do
            for c in $(docker ps -q); do
                [[ $seen == *" $c "* ]] && continue
                seen+="$c "
                docker logs -f "$c" > "${OUT:-.}/$label-server.log" 2>&1 &
            done
        done
    }
    follow &
    capture=$!
    MODEL_DIR=$MODEL DRAFTER_DIR=$DRAFTER .venv/bin/python build.py "$command" --target cuda --host native "$@" \
        2>&1 | tee "${OUT:-.}/$label.log" || rc=$?
    kill "$capture" 2>/dev/null || true  # its loop never ends by itself; a failed kill must not lose the reports
    send_reports "$before" "$label" "$rc"
    exit $rc
    ;;
*)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
