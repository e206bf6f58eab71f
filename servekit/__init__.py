"""servekit: build, deploy, check and release patched vLLM serving images from one matrix."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# smoke/ and wsl2/ sit at the repository's top level and are packages of servekit: a wheel installs them as
# servekit/smoke and servekit/wsl2 (pyproject.toml's package-dir), and a checkout links them there (servekit/smoke ->
# ../smoke), which is also how mypy sees them as what they are. Where a checkout cannot hold a link (git on Windows
# writes a text file in its place), they are found beside this folder.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "smoke" / "__init__.py").is_file() and not (_CHECKOUT / "servekit" / "smoke").is_dir():
    __path__.append(str(_CHECKOUT))
