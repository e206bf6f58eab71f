# Sourced by visit.sh and acceptance.sh (each defines say): parts carried in one folder a call, the stand-in's folders
# kept, and the reports a run adds sent back through $OUT, the folder the host hands back after each command.

# The stand-in both serve (images.yaml models.qwen35-mini) and its DFlash2 drafter, through MODEL_DIR and DRAFTER_DIR.
MODEL=${SERVEKIT_GPU_MODEL:-$PWD/bench/gpu/qwen35-mini}
DRAFTER=${SERVEKIT_GPU_DRAFTER:-$MODEL-dflash2}

# take_parts DEST DIR...: each carried folder's files into DEST, every one SHA256SUMS names checked as it lands.
take_parts() {
    local dest=$1 dir file name
    shift
    mkdir -p "$dest"
    for dir in "$@"; do
        for file in "$dir"/*; do
            cp "$file" "$dest/"
            name=$(basename "$file")
            if [ -f "$dest/SHA256SUMS" ] && grep -q "  $name\$" "$dest/SHA256SUMS"; then
                (cd "$dest" && grep "  $name\$" SHA256SUMS | sha256sum --check --quiet) && say "$name ok"
            fi
        done
    done
}

# send_reports BEFORE NAME RC: the reports added since the listing BEFORE (an interrupted run's too), tarred to
# ${OUT:-.}/NAME.tar.
send_reports() {
    local new
    new=$(comm -13 <(echo "$1" | sort) <(ls reports | sort) | grep -v '^latest' || true)
    [ -n "$new" ] && tar -C reports -cf "${OUT:-.}/$2.tar" $new
    say "$2: exit $3, reports: ${new:-none}"
}

# The stand-in's folders travel once, with the whole tree (the tree travels without them beside the parts): keep
# copies them to $HOME, restore puts them back in the tree before a run. They are served from the tree, where the
# matrix names them: a copy elsewhere is not recognised as the stand-in (its checks' parameters and the checks it
# cannot pass are then not applied).
# A folder counts by its config.json: the sparse tree arrives with the folders left empty.
whole() { [ -f "$1/config.json" ]; }
keep() { for d in "$MODEL" "$DRAFTER"; do whole "$d" && ! whole "$HOME/${d##*/}" && copy "$d" "$HOME/${d##*/}"; done; true; }
restore() { for d in "$MODEL" "$DRAFTER"; do whole "$d" || copy "$HOME/${d##*/}" "$d"; done; }
copy() { rm -rf "$2" && cp -r "$1" "$2"; }
