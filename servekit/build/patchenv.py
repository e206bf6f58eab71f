"""`patch-env`: the patch series and components applied to a Python environment installed by hand, as the image
build applies them, so that the process engine (`--engine venv:PATH`) serves the target's stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from servekit.build.builder import replace_tree, stage_components
from servekit.build.plan import plan_for
from servekit.config.session import Session
from servekit.errors import UserError
from servekit.image import module_command, module_env
from servekit.image.components import MANIFEST
from servekit.image.series import check_applied, read_series, settled_files, site_vllm_dir
from servekit.layout import staged_env
from servekit.output import Say


def patch_environment(session: Session, target: str, python: str, say: Say = print) -> list[str]:
    """Apply the patch series and the components to the vLLM of the environment whose interpreter is `python`,
    with the code and inputs the image build uses; what was applied. An environment already patched is left
    as it is; one patched in part is refused."""
    interpreter = Path(python).expanduser()
    if not os.access(interpreter, os.X_OK):
        raise UserError(f"--python {python}: no interpreter there; make the environment as docs/install.md says")
    matrix = session.matrix
    plan = plan_for(session, target)
    staged = staged_env(session.root, target)
    settled = settled_files(staged / "components" / MANIFEST)  # from an earlier patch-env
    replace_tree(staged / "patches", session.root / matrix.series.dir)
    stage_components(matrix, plan, session.root, staged / "components")
    vllm_dir = site_vllm_dir(str(interpreter))
    if not vllm_dir.is_dir():
        raise UserError(f"--python {python}: vLLM is not installed in that environment ({vllm_dir})")
    mine = [p.name for p in read_series(staged / "patches") if p.applies_to(target)]
    unapplied = check_applied(staged / "patches", vllm_dir, target, settled)
    if not unapplied:
        say(f"patch-env: the series ({len(mine)} patches) is already applied in {vllm_dir}")
        return []
    if len(unapplied) != len(mine):
        raise UserError(f"{vllm_dir}: the series is applied in part ({unapplied[0]}); reinstall vLLM there "
                        "(pip install --force-reinstall --no-deps) and run patch-env again")
    for script, args in (("series", ["apply", "--series-dir", str(staged / "patches"), "--target", target]),
                         ("components", ["install", "--spec", str(staged / "components" / "components.json"),
                                         "--components-dir", str(staged / "components")])):
        done = subprocess.run([*module_command(sys.executable, script), *args, "--python", str(interpreter)],
                              capture_output=True, text=True, env=module_env(os.environ))
        for line in (done.stdout + done.stderr).splitlines():
            say(f"patch-env: {line}")
        if done.returncode != 0:
            raise UserError(f"patch-env: {script} {args[0]} failed (exit {done.returncode}); its output is above")
    return mine
