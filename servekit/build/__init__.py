"""Stage 2, the image: pins and locks, the patch series' checks, the plan (what an image bakes in, its digest and
tag), bases, the BuildKit build, the demo model, and `patch-env` for an environment installed by hand."""
