#!/usr/bin/env bash
# The cuda target's acceptance on a GPU machine that has neither Docker nor a network: the
# pinned stack installed beside what the machine has, patched as the image is, qwen35-mini (the served family's
# stand-in, images.yaml) with its drafter, and every boot through the process engine (--engine venv:PATH). docs/gpu/README.md says
# what was run with it and what it showed.
#
# From the repository root, on the GPU machine:
#   bench/gpu/acceptance.sh take DIR...         # copy carried folders of `python bench/gpu/wheels.py PARTS_DIR`
#                                               # (here) into ~/wheel-parts, each part checked against SHA256SUMS
#   bench/gpu/acceptance.sh install [PARTS]     # check them all, make the venv, patch-env (default ~/wheel-parts)
#   bench/gpu/acceptance.sh run ARGS...         # python build.py run ARGS on it (reports under reports/; a cold
#                                               # boot of the process engine passes 150 s: leave `run` room)
#   bench/gpu/acceptance.sh sweep ARGS...       # python build.py sweep ARGS on it
set -euo pipefail

ENV=${SERVEKIT_GPU_ENV:-$HOME/vllm-cuda}
PARTS=${SERVEKIT_GPU_WHEEL_PARTS:-$HOME/wheel-parts}
export SERVEKIT_WITHOUT=flashinfer-cubin  # served only by FlashInfer's own index; its JIT builds what it needs
say() { echo "acceptance: $*" >&2; }
. "$(dirname "$0")/carried.sh"

case "${1:-}" in
take)
    shift
    keep
    take_parts "$PARTS" "$@"
    ;;
install)
    parts=$(cd "${2:-$PARTS}" && pwd)
    say "checking $(ls "$parts" | grep -c '^part-') parts"
    (cd "$parts" && sha256sum --check --quiet <(grep -v ' wheels/' SHA256SUMS))
    only_named "$parts"
    rm -rf -- "$parts/wheels" && (cd "$parts" && cat part-* | tar -x && sha256sum --check --quiet \
        <(grep ' wheels/' SHA256SUMS))
    say "$(ls "$parts/wheels" | wc -l) wheels verified"
    python3 -m venv --without-pip "$ENV"
    site=$("$ENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # The machine's own packages (its CUDA libraries, matplotlib) after the environment's, which win.
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz-machine.pth"
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$parts"/wheels/*.whl
    # build.py and its checks run in this environment too: it is refused short of the host tool's dependencies.
    "$ENV/bin/python" - <<'EOF'
import importlib.metadata as m, re, sys, tomllib
declared = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
missing = []
for name in (re.match(r"[A-Za-z0-9._-]+", d)[0] for d in declared):
    try:
        m.version(name)
    except m.PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"acceptance: the host tool needs {', '.join(missing)}, not in the parts: pack them again here "
             "(python bench/gpu/wheels.py PARTS_DIR)")
import torch
print("acceptance:", {d: m.version(d) for d in ("vllm", "torch", "triton", "flashinfer-python", "transformers")},
      torch.cuda.get_device_name(0))
EOF
    # patch from the parts (only_named checked it against SHA256SUMS) where the machine has none
    command -v patch >/dev/null || { mkdir -p "$HOME/bin" && cp -- "$parts/patch" "$HOME/bin/" && say "patch from the parts"; }
    PATH=$HOME/bin:$PATH "$ENV/bin/python" build.py patch-env --python "$ENV/bin/python" --target cuda
    ;;
run|sweep)
    command=$1
    shift
    restore
    mkdir -p reports
    before=$(ls reports)
    rc=0  # the host is native unless ARGS name another (a later --host wins)
    MODEL_DIR=$MODEL DRAFTER_DIR=$DRAFTER PATH=$HOME/bin:$PATH "$ENV/bin/python" build.py "$command" \
        --engine "venv:$ENV" --target cuda --host native "$@" || rc=$?
    send_reports "$before" "$command-$(date +%H%M%S)" "$rc"
    exit $rc
    ;;
*)
    sed -n '2,14p' "$0" >&2
    exit 2
    ;;
esac
