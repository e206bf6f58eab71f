"""servekit: build, deploy, check and release patched vLLM serving images from one matrix."""

__version__ = "0.1.0"
