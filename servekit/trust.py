"""Which CA bundle to trust for HTTPS, so that a proxy that re-signs TLS keeps working.

The same bundle goes into builds as a BuildKit secret (never a layer).
"""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")


def ca_bundle() -> Path | None:
    """The first CA bundle named by the environment, else the system's; None when there is none."""
    for var in ("SERVEKIT_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "PIP_CERT"):
        value = os.environ.get(var)
        if value and Path(value).is_file():
            return Path(value)
    return next((Path(p) for p in SYSTEM_BUNDLES if Path(p).is_file()), None)


def requests_verify() -> str | bool:
    bundle = ca_bundle()
    return str(bundle) if bundle else True
