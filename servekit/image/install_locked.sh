#!/bin/sh
# Install one slice of the target's lock into /opt/venv exactly: hash-checked, no dependency resolution, wheels
# only; the build's secrets (a CA bundle, a pip configuration with the indexes) where the build was given them,
# and the wheelhouse bind-mounted at /wheels. The Dockerfile runs it once per layer.
set -eu
requirements=$1
set --
if [ -s /run/secrets/cacert ]; then set -- --cert /run/secrets/cacert; fi
if [ -s /run/secrets/pip_conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip_conf; fi
exec /usr/bin/python3 -m pip --python /opt/venv/bin/python install --progress-bar off "$@" --find-links /wheels \
    --require-hashes --no-deps --only-binary=:all: -r "$requirements"
