"""The code that runs inside the image: launcher, knobs, model prepare, series apply, component
install, the hub client, the launch recipe and the in-image verify. Each module loads with the
standard library alone (a test enforces it): the series and the components are applied by the
base's own Python before any wheel is there, and the host imports the knob table without the
serving stack. Only inside a function may one use a package the target's own lock installs (prepare's
huggingface_hub). This folder is what the Dockerfile copies to /opt/servekit, what .dockerignore admits and what
the image's digest covers.
"""

from pathlib import Path

CODE_DIR = Path(__file__).resolve().parent  # the launcher and its siblings, as the image has them (/opt/servekit)
