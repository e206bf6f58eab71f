"""A deployment: what an engine is asked to serve and where (the checkout, target, host, image, address, the model
folders and card), below the stages that make it (serve/ready.py) and beside the engines that serve it; and the
user the containers run as."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from servekit.config.matrix import Matrix
from servekit.engines import resolve
from servekit.engines.card import Emulation
from servekit.engines.docker import local_url
from servekit.engines.protocol import Engine
from servekit.layout import SECRETS_DIR


@dataclass(frozen=True)
class Deployment:
    """One target's image served from one checkout on one engine, at one address: what every engine reads to serve
    it, in no engine's words (the Docker engine makes its Compose files and .env of it, engines/compose.py)."""

    root: Path
    target: str
    host: str
    image: str
    bind: str
    port: int
    engine: Engine = field(default_factory=lambda: resolve(None))
    reached_at: str | None = None  # the URL through which this machine reaches it, when not the plain one
    overrides: tuple[str, ...] = ()  # the target's Compose override files in compose/ (images.yaml: compose)
    matrix: Matrix | None = field(default=None, compare=False)  # images.yaml, loaded (the process engine renders from it)
    pins: dict[str, str] = field(default_factory=dict, compare=False)  # the target's, less what --without leaves out
    left_out: tuple[str, ...] = ()  # the series' patches the image's build left out (--without): never released
    gpu_devices: bool = False  # the GPU by its device nodes and driver folder (engines/gpuaccess.py), not the toolkit
    model_dir: str | None = None  # a model folder of this machine served in place of the volume's (MODEL_DIR)
    stand_in: str | None = None  # the matrix model that folder is (stands_in_for the target's): its checks apply
    drafter_dir: str | None = None  # a DFlash2 drafter folder of this machine served in place of the volume's
    card: Emulation | None = None  # a smaller card emulated on this machine's GPU (--card)

    @property
    def url(self) -> str:
        return self.reached_at or local_url(self.bind, self.port)

    @property
    def api_key_file(self) -> Path:
        return self.root / SECRETS_DIR / "api_key"
