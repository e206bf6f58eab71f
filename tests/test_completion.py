"""Shell completion: the script `servekit completion SHELL` prints completes the real commands and options."""

from __future__ import annotations

import subprocess
import sys

from support import ROOT


def _complete(words: list[str]) -> list[str]:
    """What bash offers for the last word, from the script as a user would source it."""
    script = f"""source <({sys.executable} {ROOT / 'build.py'} completion bash)
COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}; COMP_LINE="{' '.join(words)}"; COMP_POINT=${{#COMP_LINE}}
_shtab_servekit; printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return sorted(done.stdout.split())


def test_bash_completes_commands_and_their_options():
    assert _complete(["servekit", "lo"]) == ["lock", "logs"]
    assert "--host-tool" in _complete(["servekit", "lock", "--h"])
    assert _complete(["servekit", "completion", "z"]) == ["zsh"]


def test_the_zsh_script_names_every_command():
    from servekit.cli import build_parser
    script = subprocess.run([sys.executable, str(ROOT / "build.py"), "completion", "zsh"], capture_output=True,
                            text=True, timeout=60).stdout
    assert script.startswith("#compdef servekit")
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices or {}
    missing = [name for name in commands if f"\n    {name}:'" not in script]
    assert missing == []
