"""The commands of images: image, reproduce, demo-model, patch-env."""

from __future__ import annotations

import argparse

from servekit import arguments
from servekit.commands.console import channel, emit_json, open_session
from servekit.commands.parsing import Commands
from servekit.image.demomodel import STEPS

# Each command imports its stage when it runs, inside its function: `--help`, completion and a refused argument
# answer in a tenth of a second, without loading the engine's SDK, pydantic or Rich (a second and more).


def cmd_image(args: argparse.Namespace) -> int:
    from servekit.build.builder import build_targets
    from servekit.serve.ready import ready_for_compose
    session = open_session(args)
    results = build_targets(session, args.target, args.force or args.no_cache, say=channel("image: "),
                            no_cache=args.no_cache)
    ready_for_compose(session, results[-1].target, results[-1].tag)  # for `docker compose up PROFILE` in compose/
    if args.json:
        emit_json({"images": [{"target": r.target, "tag": r.tag, "built": r.built, "seconds": round(r.seconds, 1),
                                "log": str(r.log) if r.log else None} for r in results]})
        return 0
    for r in results:
        print(f"{r.target}: {r.tag} " + (f"built in {r.seconds:.0f} s (log: {r.log})" if r.built else
                                          "already built; nothing to do"))
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from servekit.build.reproduce import reproduce
    from servekit.engines import choice
    session = open_session(args)
    result = reproduce(session, choice.target(session, args.target), say=channel("reproduce: "))
    if args.json:
        emit_json(result.as_json())
    else:
        first = f"{result.first_seconds:.0f} s" if result.first_seconds is not None else "already built"
        print(f"{result.target}: {result.tag}\n  first build: {result.first_id} ({first})\n  rebuild:     "
              f"{result.second_id} ({result.second_seconds:.0f} s, the builder's cache unused)")
        print("  the same image: the inputs decide it" if result.same else
              "  different images; the first keeps the tag:\n" + "\n".join(f"    {d}" for d in result.differences))
    return 0 if result.same else 1


def cmd_demo_model(args: argparse.Namespace) -> int:
    from servekit.build.retrain import regenerate_shipped
    dest = regenerate_shipped(open_session(args), say=channel(), steps=args.steps)
    print(f"demo-model: {dest} replaced; `make demo` and `make test` use it")
    return 0


def cmd_stand_in(args: argparse.Namespace) -> int:
    from servekit.build.standin import default_out, write_stand_in
    session = open_session(args)
    out = args.out or default_out(session, args.target)
    model, drafter = write_stand_in(session, out, not args.no_drafter, args.seed, args.scale, args.target,
                                    convert=not args.as_published, say=channel())
    print(f"stand-in: serve it with MODEL_DIR={model.resolve()}"
          + (f" DRAFTER_DIR={drafter.resolve()}" if drafter else ""))
    return 0


def cmd_patch_env(args: argparse.Namespace) -> int:
    from servekit.build.patchenv import patch_environment
    from servekit.engines import choice
    session = open_session(args)
    applied = patch_environment(session, choice.target(session, args.target), args.python, say=channel())
    if args.json:
        emit_json({"applied": applied})
    return 0


def register(c: Commands) -> None:
    p = c.add("image", cmd_image, "build the image of a target (content-addressed: an image already built for "
            "its digest is not rebuilt)", locked=True)
    c.target(p, many=True)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.add_argument("--no-cache", action="store_true", help="with --force: run every step again, BuildKit's cache "
                   "unused (slow: every wheel is installed again)")
    p = c.add("reproduce", cmd_reproduce, "build a target's image again with the builder's cache unused and check "
              "it is the same image ID (exit 1 naming the layers and first files that differ)", locked=True)
    c.target(p)
    p = c.add("demo-model", cmd_demo_model, "train the shipped demo model again (a few CPU minutes, in the image of "
              "the target that serves it) and replace its folder (images.yaml models.<name>.dir) if the result does "
              "what the checks ask", json_out=False, locked=True)
    p.add_argument("--steps", type=arguments.count, default=STEPS, metavar="N",
                   help=f"training steps (default {STEPS}, the shipped model's; fewer give a model that may not do "
                   "what the checks ask, which then leaves the shipped one as it was)")
    p = c.add("stand-in", cmd_stand_in, "write the served checkpoint's exact architecture and file layout with random "
              "weights (seeded, about 19.5 GB) and a DFlash2 drafter of the served size, into a MODELS_DIR, through the "
              "image: the product's memory at full size on a host without the hub", json_out=False, locked=True)
    p.add_argument("--out", type=arguments.folder, metavar="DIR", help="the models folder: the model and drafter land in their source "
                   "folders there (images.yaml source_folder); default .cache/stand-in, where MODEL_DIR naming the "
                   "model is judged as the stand-in images.yaml names (models.qwen38-27b-random)")
    p.add_argument("--as-published", action="store_true", help="leave it as published: without prepare's int8 "
                   "conversions (which are otherwise run and timed), the MTP linears missing from ignore")
    p.add_argument("--seed", type=arguments.seed, default=0, metavar="N", help="the random weights' seed (default 0)")
    p.add_argument("--scale", choices=("full", "small"), default="full", help="small: the same layout at a few MB")
    p.add_argument("--no-drafter", action="store_true", help="the model only")
    c.target(p)
    p = c.add("patch-env", cmd_patch_env, "apply the patch series and components to the vLLM of a Python environment "
            "you installed from docs/install.md (what the image build does), for the process engine", locked=True)
    p.add_argument("--python", required=True, metavar="PATH", help="the environment's interpreter, e.g. "
                   "/opt/venv/bin/python")
    c.target(p, help="the target whose series applies (default: the first GPU target where this machine has a "
               "GPU, else the first without one)")

