# Sourced by visit.sh, acceptance.sh and behind.sh (each defines say and sets -euo pipefail): parts carried in one
# folder a call, the stand-in's folders kept, and the reports a run adds sent back through $OUT, the folder the host
# hands back after each command. Every argument that names a file or counts is checked before it is used.
set -u

# plain_name WHAT VALUE: a job name or label names files in a folder: one word, never a path that climbs out.
plain_name() {
    [[ $2 =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$ ]] || { say "$1 '$2': expected a plain name (letters, digits, . _ -)"; exit 2; }
}

# whole_number WHAT VALUE: a count of seconds, checked as digits before any arithmetic sees it (bash evaluates what
# $(( )) is given, commands in array subscripts included).
whole_number() {
    [[ $2 =~ ^[0-9]{1,7}$ ]] || { say "$1 '$2': expected a whole number"; exit 2; }
}

# folder_path WHAT VALUE: a folder's path without trailing slashes, refused when nothing of it is left (or it is /).
folder_path() {
    local path=$2
    while [[ $path == */ ]]; do path=${path%/}; done
    [[ -n $path && -n ${path##*/} ]] || { say "$1 '$2': expected a folder's path"; exit 2; }
    printf '%s' "$path"
}

# The stand-in both serve (images.yaml models.qwen35-mini) and its DFlash2 drafter, through MODEL_DIR and DRAFTER_DIR.
MODEL=$(folder_path SERVEKIT_GPU_MODEL "${SERVEKIT_GPU_MODEL:-$PWD/bench/gpu/qwen35-mini}") || exit 2
DRAFTER=$(folder_path SERVEKIT_GPU_DRAFTER "${SERVEKIT_GPU_DRAFTER:-$MODEL-dflash2}") || exit 2

# take_parts DEST DIR...: each carried folder's files into DEST, every one SHA256SUMS names checked as it lands (one
# that arrives before the sums, or that they do not name, is for only_named to judge).
take_parts() {
    local dest=$1 dir file name line
    shift
    mkdir -p "$dest"
    for dir in "$@"; do
        for file in "$dir"/*; do
            [ -f "$file" ] || { say "$file: not a file of parts; nothing taken from it"; exit 1; }
            cp -- "$file" "$dest/"
            name=${file##*/}
            [ -f "$dest/SHA256SUMS" ] && [ "$name" != SHA256SUMS ] || continue
            line=$(named "$name" "$dest/SHA256SUMS")
            if [ -n "$line" ]; then
                (cd "$dest" && sha256sum --check --quiet <<< "$line") && say "$name ok"
            else
                say "$name: not named in SHA256SUMS (setup refuses it)"
            fi
        done
    done
}

# named NAME SUMS: the line of SUMS that names NAME exactly (as sha256sum writes it, text or binary mode), or nothing.
named() { awk -v n="$1" '$2 == n || $2 == "*" n' "$2"; }

# only_named DIR EXTRA...: every file in DIR but SHA256SUMS and the EXTRA names is named in SHA256SUMS (which the
# caller checks): a part nobody checked is never used.
only_named() {
    local dir=$1 file name
    shift
    for file in "$dir"/*; do
        name=${file##*/}
        [ -f "$file" ] && [ "$name" != SHA256SUMS ] && [[ " $* " != *" $name "* ]] || continue
        [ -n "$(named "$name" "$dir/SHA256SUMS")" ] ||
            { say "$file: not named in SHA256SUMS, so never checked; remove it or pack again"; exit 1; }
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
empty() { [ ! -e "$1" ] || { [ -d "$1" ] && [ -z "$(ls -A "$1")" ]; }; }
keep() { for d in "$MODEL" "$DRAFTER"; do whole "$d" && ! whole "$HOME/${d##*/}" && copy "$d" "$HOME/${d##*/}"; done; true; }
# A folder is put back only where the sparse carry left it empty (or absent): one that holds files of its own without
# a config.json is someone's, and stays.
restore() {
    local d
    for d in "$MODEL" "$DRAFTER"; do
        whole "$d" && continue
        empty "$d" || { say "$d holds files but no config.json: not replaced; empty it or fix it"; exit 1; }
        whole "$HOME/${d##*/}" || { say "no whole copy of ${d##*/} in $HOME to put back: carry the tree whole once"; exit 1; }
        copy "$HOME/${d##*/}" "$d"
    done
}
# copy FROM TO: TO replaced by a copy of FROM; never the home folder, the root or a path with nothing in it.
copy() {
    local to
    to=$(folder_path "copy to" "$2") || exit 1
    [[ $to != "$HOME" && $to != "${HOME%/}" && $to != . && $to != .. ]] || { say "refusing to replace $2"; exit 1; }
    rm -rf -- "$to" && cp -r -- "$1" "$to"
}
