#!/bin/sh
# Install one slice of the target's lock into /opt/venv exactly: hash-checked, no dependency resolution, wheels
# only; the build's secrets (a CA bundle, a pip configuration with the indexes) where the build was given them,
# and the wheelhouse bind-mounted at /wheels. The Dockerfile runs it once per layer. The wheels are downloaded into
# a folder of this step's own first and installed from there, so the file installed of each distribution is known:
# its SHA-256 goes to /opt/servekit/installed/<slice>.json, which the SBOM is narrowed to (servekit.image.installed).
set -eu
requirements=$1
set --
if [ -s /run/secrets/cacert ]; then set -- --cert /run/secrets/cacert; fi
if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi
downloaded=$(mktemp -d)
trap 'rm -rf "$downloaded"' EXIT
/usr/bin/python3 -m pip --python /opt/venv/bin/python download --progress-bar off "$@" --find-links /wheels \
    --require-hashes --no-deps --only-binary=:all: --dest "$downloaded" -r "$requirements"
/usr/bin/python3 -m pip --python /opt/venv/bin/python install --progress-bar off --no-index \
    --find-links "$downloaded" --require-hashes --no-deps --only-binary=:all: -r "$requirements"
/usr/bin/python3 -m servekit.image.installed record "$downloaded" \
    "/opt/servekit/installed/$(basename "$requirements" .txt).json"
