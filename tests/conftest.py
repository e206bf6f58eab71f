"""Fixtures and hooks: throwaway copies of the repository, the cpu image (built once a session), and the check
that the tests left the checkout as they found it (support.py holds the shared helpers)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import grouping  # noqa: E402
import summary_lines  # noqa: E402
import support  # noqa: E402
from support import ROOT, TEST_PROJECT, run_build_py  # noqa: E402

# pytest caches a test module's rewritten asserts as bytecode; where the environment forbids bytecode
# (PYTHONDONTWRITEBYTECODE), every worker rewrote every module at each start: about 2.5 s of each worker's collection.
# The cache goes to the checkout's ignored .cache, never beside the sources; subprocesses keep the environment's rule.
sys.dont_write_bytecode = False
sys.pycache_prefix = sys.pycache_prefix or str(ROOT / ".cache" / "pycache")

LEFT_ALONE = "test_left_alone.py::test_the_checkout_and_its_servers_are_as_the_tests_found_them"


def pytest_configure(config):
    from servekit.engines.card import MPS_DIR_ENV
    # the whole suite, as `make test` and CI run it (test-fast builds no image, one module rarely more than one)
    whole = {Path(arg).resolve() for arg in config.args} <= {ROOT / "tests"}
    if not support.WORKER and whole and "not slow" not in (config.option.markexpr or ""):
        short = support.disk_shortfall()
        if short:
            pytest.exit(short, returncode=pytest.ExitCode.USAGE_ERROR)
    support.STATE_AT_START.update(support.checkout_state())
    os.environ["SERVEKIT_PROJECT"] = TEST_PROJECT  # for the commands run in-process and in subprocesses alike
    os.environ[MPS_DIR_ENV] = str(support.MPS_DIR)  # never the machine's own MPS folder
    # Hypothesis keeps its caches in ./.hypothesis unless told: the run's temporary folder, not the checkout
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(support.HYPOTHESIS_DIR))
    summary_lines.register(config)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    """The check that the checkout was left alone runs after every other test, whatever the files' names; under
    pytest-xdist (`make test` runs two workers) the controller runs it once every worker has ended, and each module
    is one group of one worker, so that its module-wide fixtures (a server it boots once) run once. A module that
    shares something outside itself with another (the second engine) names a group of its own."""
    items.sort(key=lambda item: item.nodeid.endswith(LEFT_ALONE))
    if support.WORKER:
        items[:] = [item for item in items if not item.nodeid.endswith(LEFT_ALONE)]
    grouping.by_module(items)


def pytest_sessionfinish(session, exitstatus):
    support.cleanup()
    if not support.WORKER and session.config.pluginmanager.hasplugin("dsession"):  # a parallel run's controller
        left = support.left_as_found()
        if left:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            reporter.ensure_newline()
            reporter.write_line(f"FAILED the checkout and its servers are not as the tests found them: {left}",
                                red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def copied() -> tuple[str, ...]:
    """The matrix, the files that repeat its pins, and every file `derive` writes into."""
    from servekit.config.derived import PARTS
    return ("images.yaml", "images.schema.json", "docker/locks", "requirements.in", "requirements.lock",
            "docker/patches", "docs/install.md", "compose", *PARTS)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the matrix and its mirror files (serving on the tests' port); the caches come along so tests stay
    fast."""
    for rel in copied():
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    support.on_test_port(tmp_path / "images.yaml")
    cache = ROOT / ".cache" / "metadata"
    if cache.is_dir():
        shutil.copytree(cache, tmp_path / ".cache" / "metadata")  # a copy: tests delete from it
    pristine = ROOT / ".cache" / "pristine"
    if pristine.is_dir():  # (it can appear mid-run, fetched by another test, where no metadata came before it)
        (tmp_path / ".cache").mkdir(exist_ok=True)
        (tmp_path / ".cache" / "pristine").symlink_to(pristine)  # read only, and large
    return tmp_path


@pytest.fixture
def cli(capsys):
    """Run the command line in-process: returns (exit code, stdout, stderr)."""
    from servekit.cli import main

    def run(*argv: str):
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


@pytest.fixture(scope="session")
def cpu_base() -> str:
    """The cpu target's base image, made here as a build would make it (a no-op once it is there)."""
    from servekit.build.bases import ensure_made_base
    from servekit.config.load import load_matrix
    matrix = load_matrix(ROOT / "images.yaml")
    name = next(t.bases[0] for t in matrix.targets.values() if not t.gpu)
    ensure_made_base(name, matrix.bases[name], ROOT / ".cache" / "bases", say=lambda line: None)
    return matrix.bases[name].image




@pytest.fixture(scope="session")
def second():
    """The URL of the run's second Docker engine (its slot's, tests/second_engine.py), started if it does not answer
    and then stopped at the end of the run by this fixture alone. The modules that use it share one xdist group
    (`second-engine`), so one worker has it and no test stops it under another. Its data folder outlives the run,
    so that the next finds today's image there; images of earlier builds would pile up in it (GBs each), so only
    today's cpu image stays."""
    import second_engine
    engine = second_engine.for_slot(support.SLOT)
    engine.start()
    watch = second_engine.SocketWatch(engine)  # a flake under load lost this socket under a live dockerd: who?
    watch.start()
    yield engine.url
    watch.stop()
    current = support.cpu_tag()
    names = support.docker("--host", engine.url, "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    stale = [n for n in names if n.split(":")[0] == current.split(":")[0] and n != current]
    if stale:
        support.docker("--host", engine.url, "image", "rm", *stale)
    support.docker("--host", engine.url, "image", "prune", "-f")
    support.docker("--host", engine.url, "network", "prune", "-f")  # their bridges would outlive the engine
    engine.stop()


@pytest.fixture(scope="session")
def cpu_image() -> str:
    """The cpu image, built once a session from the tests' copy of the repository (the checkout's tag)."""
    result = run_build_py("image", "--target", "cpu", timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    return support.cpu_tag()
