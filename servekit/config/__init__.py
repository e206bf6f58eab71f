"""Stage 1, the matrix: images.yaml loaded and validated into typed objects, this machine's build settings, each
profile's knobs resolved, and the files derived from them (Compose services, the docs' tables, .dockerignore)."""
