"""The commands of releasing and deploying elsewhere: release, pull, render."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servekit import arguments
from servekit.commands.console import channel, emit_json, open_session
from servekit.commands.parsing import Commands

# Each command imports its stage when it runs, inside its function: `--help`, completion and a refused argument
# answer in a tenth of a second, without loading the engine's SDK, pydantic or Rich (a second and more).


REGISTRY_HELP = "default: SERVEKIT_REGISTRY (the shell, else compose/.env), else release.registry in images.yaml"


def cmd_release(args: argparse.Namespace) -> int:
    from servekit.release.publish import release, summary_text
    from servekit.release.verify import verify_release
    session = open_session(args)
    if args.verify:
        problems = verify_release(session, say=channel())
        for problem in problems:
            print(f"problem: {problem}")
        print("release: the registry serves every digest the release names" if not problems else
              f"release: {len(problems)} problem(s)")
        return 1 if problems else 0
    manifest, releases = release(session, args.registry, args.target, args.dry_run, args.git_tag, say=channel())
    if manifest is None:
        print("release: dry run; nothing pushed")
    elif args.json:
        emit_json({"manifest": str(manifest), "releases": [r.model_dump() for r in releases]})
    else:
        print(summary_text(session.matrix, releases))
        rel = manifest.relative_to(session.root)
        print(f"manifest: {rel}" + (f" (committed, tagged v{session.matrix.vllm})" if args.git_tag else
                                    "; commit it: it is the record of this release that `release --verify` and "
                                    "`render k8s` read"))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from servekit.engines import choice
    from servekit.release.fetch import pull_release
    from servekit.serve.ready import ready_for_compose
    session = open_session(args)
    pulled = pull_release(session, choice.target(session, args.target), args.registry,
                          say=channel("pull: "), moving=args.moving)
    ready_for_compose(session, pulled.target, pulled.tag)  # for `docker compose up PROFILE` in compose/
    if args.json:
        emit_json({"target": pulled.target, "reference": pulled.reference, "tag": pulled.tag,
                    "image_id": pulled.image_id, "seconds": round(pulled.seconds, 1)})
    else:
        print(f"{pulled.target}: {pulled.reference} pulled in {pulled.seconds:.0f} s as {pulled.tag} "
              f"({pulled.image_id[:19]})")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from servekit.release.k8s import render_profile
    paths, how = render_profile(open_session(args), args.profile, Path(args.out), args.target,
                                "native" if args.host == "auto" else args.host, args.kube_version)
    print(f"image {how}", file=sys.stderr)
    print("create the key Secret first: kubectl create secret generic servekit-api-key "
          "--from-file=api-key=compose/secrets/api_key (and, for a gated model, servekit-hf-token: "
          "kubectl create secret generic servekit-hf-token --from-file=token=compose/secrets/hf_token)",
          file=sys.stderr)
    for path in paths:
        print(path)
    return 0


def register(c: Commands) -> None:
    p = c.add("release", cmd_release, "push each target's checked image: immutable and moving tags, digests read "
            "back, then releases/v<vllm>.json", locked=True)
    p.add_argument("--registry", type=arguments.registry, metavar="HOST[:PORT]/NAMESPACE", help=REGISTRY_HELP)
    c.target(p, many=True, help="only this target (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="check and report; push nothing")
    p.add_argument("--git-tag", action="store_true", help="also create an annotated git tag v<vllm> with the summary")
    p.add_argument("--verify", action="store_true", help="push nothing: read releases/v<vllm>.json back and check "
                   "that the registry still serves each tag's digest, and the SBOM the release names")
    p = c.add("pull", cmd_pull, "fetch the target's released image instead of building it (the immutable tag "
              "`release` pushed for this checkout's content digest), with its progress; `up`, `run` and a plain "
              "`docker compose up PROFILE` then use it", locked=True)
    p.add_argument("--registry", type=arguments.registry, metavar="HOST[:PORT]/NAMESPACE", help=REGISTRY_HELP)
    p.add_argument("--moving", action="store_true",
                   help="the release's moving tag (v<vllm>-<target>: the newest release of the pinned vLLM, another "
                        "build than this checkout's) instead of this checkout's own; compose/.env then names it")
    c.target(p)
    p = c.add("render", cmd_render, "render deployment manifests for one profile (Kubernetes), validated offline "
            "against the Kubernetes schemas", json_out=False)
    p.add_argument("kind", choices=["k8s"], help="what to render")
    p.add_argument("--profile", required=True, metavar="NAME")
    c.target(p)
    c.host(p, default="native")
    p.add_argument("--out", type=arguments.folder, default="k8s", metavar="DIR", help="folder to write into (default: k8s/)")
    p.add_argument("--kube-version", type=arguments.kube_version, default="1.31", metavar="X.Y", help="schema version to validate against")

