"""Stage 4, the release: the gate (passing reports of this very image), tags, labels, the push through the
engine's credentials and the manifest; Kubernetes manifests that pull the released image; a local registry for
tests and offline use."""
