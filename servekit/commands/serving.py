"""The commands of serving: up, down, ps, logs, monitor."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from servekit import arguments
from servekit.commands.console import channel, emit_json, engine_of, open_session, print_table
from servekit.commands.parsing import Commands

# Each command imports its stage when it runs, inside its function: `--help`, completion and a refused argument
# answer in a tenth of a second, without loading the engine's SDK, pydantic or Rich (a second and more).


def cmd_up(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from servekit.config.knobargs import parse_settings
    from servekit.errors import BootFailed
    from servekit.serve.commands import up_profile
    knobs = parse_settings(args.knob or [])
    try:
        with Console(stderr=True).status(f"waiting for {args.profile} to become healthy") as status:
            r = up_profile(open_session(args), args.profile, args.target, args.host, engine_of(args), args.port,
                           args.timeout, say=channel(live=lambda line: status.update(Text(line))), knobs=knobs,
                           card=args.card)
    except BootFailed as exc:
        print(f"up: {args.profile} failed: {exc}", file=sys.stderr)
        for line in exc.last_lines[-12:]:
            print(f"  | {line[:300]}", file=sys.stderr)
        return 1
    if args.json:
        emit_json(r.to_json())
        return 0
    print(f"{args.profile} is healthy at {r.url} (API key in {r.api_key_file})")
    print(f"  time to healthy {r.time_to_healthy_s} s, KV pool {r.kv_pool_tokens} tokens, "
          f"detection lag {r.detection_lag_s} s")
    if r.gpu:
        print(f"  GPU peak {r.gpu['peak_used_bytes'] / 2**30:.2f} GiB, margin "
              f"{r.gpu['min_margin_bytes'] / 2**30:.2f} GiB")
    if r.shared_usage:
        from servekit.wsl2.shared_usage import describe
        print(f"  {describe(r.shared_usage)}")
    if r.url.startswith("http"):
        print(usage_snippets(r.url, r.api_key_file, r.served_name))
    return 0


def usage_snippets(url: str, key_file: str, model: str) -> str:
    """A curl line and an OpenAI client program for the server, each reading the key from its file."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64})
    return "\n".join([
        "try it (the key is read from its file):",
        f"curl -s {url}/v1/chat/completions -H \"Authorization: Bearer $(cat {shlex.quote(key_file)})\" "
        f"-H 'Content-Type: application/json' -d '{body}'",
        "python3 - <<'EOF'",
        "from pathlib import Path",
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{url}/v1\", api_key=Path({key_file!r}).read_text().strip())",
        f"reply = client.chat.completions.create(model={model!r}, messages=[{{\"role\": \"user\", \"content\": "
        "\"Hello\"}], max_tokens=64)",
        "print(reply.choices[0].message.content)",
        "EOF"])


def cmd_down(args: argparse.Namespace) -> int:
    from servekit.serve.deploy import down_profiles
    left = down_profiles(open_session(args), engine_of(args), args.profile)
    print(f"down: {'nothing left running' if not left else 'still present: ' + ', '.join(left)}")
    return 0 if not left else 1


def cmd_ps(args: argparse.Namespace) -> int:
    from servekit.serve.deploy import status
    session = open_session(args)
    rows = status(engine_of(args), session.matrix.serve.bind)
    if args.json:
        emit_json(rows)
        return 0
    if not rows:
        print("ps: nothing runs")
        return 0
    print_table(f"engine {args.engine or 'local'}", ["profile", "state", "up", "url", "image", "knobs"],
                 [[r["profile"], r["state"] + (f" ({r['health']})" if r["health"] else ""),
                   f"{r['up_s']} s" if r["up_s"] is not None else "", r["url"], r["image"],
                   " ".join(f"{k}={v}" for k, v in r["knobs"].items())] for r in rows])
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from servekit.serve.deploy import logs
    try:
        for line in logs(args.profile, engine_of(args), follow=args.follow, tail=args.tail):
            print(line, flush=True)
    except KeyboardInterrupt:  # the way to stop following
        pass
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from servekit.machine.monitor import monitor
    result = monitor(args.seconds, args.interval, args.adapter, args.matrix, say=channel())
    if args.json:
        emit_json(result)
        return 0
    for g in result["gpus"]:
        print(f"GPU {g['index']} {g['name']}: peak {g['peak_used_bytes'] / 2**30:.3f} GiB of "
              f"{g['total_bytes'] / 2**30:.1f} GiB, margin {g['min_margin_bytes'] / 2**30:.3f} GiB, "
              f"{g['samples']} samples")
    shared = result["shared_usage"]
    if shared:
        from servekit.wsl2.shared_usage import describe
        print(describe(shared))
    return 0


def register(c: Commands) -> None:
    p = c.add("up", cmd_up, "start a profile (Compose, or a process with --engine venv:PATH) and watch it until it is "
            "healthy or has failed", locked=True)
    p.add_argument("profile", metavar="PROFILE", help="a profile of images.yaml (default, batch, alternative, ...)")
    c.target(p)
    c.host(p)
    p.add_argument("--timeout", type=arguments.seconds, metavar="S", help="seconds to wait (default: serve.boot_timeout_s)")
    p.add_argument("--knob", action="append", metavar="NAME=VALUE", help="set a knob over the profile's "
                   "(repeatable; `ps` shows what it runs with)")
    c.engine(p)
    p.add_argument("--port", type=arguments.port, metavar="N", help="publish on this port (default: serve.port)")
    c.card(p)
    p = c.add("down", cmd_down, "stop and remove a profile's containers (all profiles when none is named); "
            "volumes stay", json_out=False)
    p.add_argument("profile", nargs="?", metavar="PROFILE")
    c.engine(p)
    p = c.add("ps", cmd_ps, "list each profile's container on the engine: state and health, uptime, URL, image, knobs")
    c.engine(p)
    p = c.add("logs", cmd_logs, "print a profile's log (the last --tail lines), and with -f follow it until Ctrl-C",
            json_out=False)
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("--tail", type=arguments.lines, default=200, metavar="N", help="lines from the end to start with (default 200)")
    c.engine(p)
    p = c.add("monitor", cmd_monitor, "sample GPU memory (NVML, every 50 ms) and, on WSL2, the Windows Shared "
            "Usage counter (every second) for N seconds or until Ctrl-C, then print the summary")
    p.add_argument("--seconds", type=arguments.seconds, metavar="N", help="how long (default: until Ctrl-C)")
    p.add_argument("--interval", type=arguments.interval, default=0.05, metavar="S", help="NVML sampling interval (default 0.05)")
    p.add_argument("--adapter", metavar="LUID|NAME", help="the WSL2 adapter to read, by its LUID (whole or its last "
                   "part) or its name (any part: 'RTX 4090'); default: hosts.wsl2.adapter of images.yaml, else the "
                   "adapter with the most dedicated memory in use")

