"""The matrix's references from one section to another (a profile's target, a host's card, a check's parameters, a
path inside the checkout, a knob and its value), checked once every section has validated on its own."""

from __future__ import annotations

import difflib
import ipaddress
import re
from pathlib import Path
from urllib.parse import urlsplit

from packaging.version import Version

from servekit import credentials
from servekit.config.matrix import Matrix, ProfileTarget, substitute
from servekit.image import boundary
from servekit.image.knobs import KNOBS, masked, watched_problem
from servekit.smoke import param_problems

# Names that become folder names, Compose services, tags and Kubernetes names (servekit-<profile>): one safe
# pattern; checks are Python functions, so theirs allows an underscore instead of a hyphen.
SAFE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
CHECK_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def _inside(root: Path, rel: str) -> str | None:
    """Why `rel` is not a path inside the folder `root` (the one rule for every path the matrix names), or None."""
    if problem := boundary.relative_inside(rel):
        return f"expected {problem}"
    if not (root / rel).resolve().is_relative_to(root.resolve()):
        return f"{rel!r} leads outside {root.name or root} (a link?)"
    return None


class References:
    """Every reference from one section of the matrix to another, checked section by section; `problems` holds
    (location, message) per problem."""

    def __init__(self, m: Matrix, root: Path) -> None:
        self.m, self.root = m, root
        self.problems: list[tuple[tuple, str]] = []

    def add(self, loc: tuple, message: str) -> None:
        self.problems.append((loc, message))

    def need(self, value: str, table: dict, what: str, loc: tuple) -> None:
        if value not in table:
            self.add(loc, f"{what} {value!r} is not defined; expected one of: {', '.join(table) or 'none'}")

    def knobs(self, table: dict[str, str], loc: tuple) -> None:
        for name, value in table.items():
            knob = KNOBS.get(name)
            if knob is None:
                close = difflib.get_close_matches(name, KNOBS, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"expected one of {', '.join(KNOBS)}"
                self.add((*loc, name), f"unknown knob {name!r}; {hint}")
            elif problem := knob.check(value) or watched_problem(name, value):
                self.add((*loc, name), f"{name}={masked(value)!r}: {problem}")

    def check_params(self, check: str, params: dict | None, loc: tuple) -> None:
        """The check is defined and implemented, then each parameter fits it; `loc` is where they are written."""
        if loc[0] != "checks":
            self.need(check, self.m.checks, "check", loc)
            if check not in self.m.checks:
                return
        unimplemented = param_problems(check, {})
        if unimplemented:
            self.add(loc[:-1] if loc[-1] == "params" else loc, unimplemented[0])
            return
        for key, value in (params or {}).items():
            self.problems.extend(((*loc, key), p) for p in param_problems(check, {key: value}))

    def all(self) -> list[tuple[tuple, str]]:
        for section in (self.names, self.indexes_and_pins, self.paths, self.checks, self.models, self.bases,
                        self.targets, self.hosts, self.components, self.profiles):
            section()
        return self.problems

    def names(self) -> None:
        m = self.m
        for section in ("indexes", "bases", "models", "targets", "cards", "hosts", "components", "profiles"):
            for name in getattr(m, section):
                if not SAFE_NAME.match(name):
                    self.add((section, name), f"name {name!r}: expected lowercase letters, digits and '-', starting "
                             "with a letter, at most 40 characters")
        for name in m.checks:
            if not CHECK_NAME.match(name):
                self.add(("checks", name), f"name {name!r}: expected lowercase letters, digits and '_'")

    def indexes_and_pins(self) -> None:
        m = self.m
        for name, spec in m.indexes.items():
            if urlsplit(spec.url).username or urlsplit(spec.url).password:
                self.add(("indexes", name, "url"), f"credentials in images.yaml would be committed: remove them from "
                         f"the URL and set {credentials.env_name(name)}=user:token in the environment")
        for name, version in m.pins.items():
            parsed = Version(version)
            if parsed.local or parsed.epoch:
                self.add(("pins", name), f"{version!r}: expected a plain release version (no '+local' or epoch: it "
                         "goes into image tags); a local label goes in targets.<t>.torch_local_version")
        for pkg, index in m.package_index.items():
            self.need(index, m.indexes, "index", ("package_index", pkg))
            self.need(pkg, m.pins, "pinned package", ("package_index", pkg))
        for pkg in m.may_omit:
            self.need(pkg, m.pins, "pinned package", ("may_omit", pkg))
        try:
            ipaddress.ip_address(m.serve.bind)
        except ValueError:
            self.add(("serve", "bind"), f"{m.serve.bind!r}: expected an IP address such as 127.0.0.1")

    def paths(self) -> None:
        """Every path the matrix names stays inside the repository; a component's patches inside its source."""
        m = self.m
        paths: list[tuple[tuple, str]] = [(("series", "dir"), m.series.dir)]
        paths += [(("components", n, "source"), c.source) for n, c in m.components.items()]
        paths += [(("models", n, "dir"), model.dir) for n, model in m.models.items() if model.dir]
        paths += [(("pin_mirrors", i), rel) for i, rel in enumerate(m.pin_mirrors)]
        for loc, rel in paths:
            if problem := _inside(self.root, rel):
                self.add(loc, problem)
        for name, c in m.components.items():
            if _inside(self.root, c.source) is None:
                for i, patch in enumerate(c.patches):
                    unknown = [pin for pin in re.findall(r"\{pin:([^}]*)\}", patch) if pin not in m.pins]
                    if unknown:
                        self.add(("components", name, "patches", i), f"{{pin:{unknown[0]}}} names no pin; expected "
                                 f"one of {', '.join(m.pins)}")
                    elif problem := _inside(self.root / c.source, substitute(patch, m)):
                        self.add(("components", name, "patches", i), problem)

    def checks(self) -> None:
        for name, c in self.m.checks.items():
            self.check_params(name, c.params, ("checks", name, "params"))
            for host in c.hosts:
                self.need(host, self.m.hosts, "host", ("checks", name, "hosts"))

    def models(self) -> None:
        for name, model in self.m.models.items():
            for check, sizes in model.checks.items():
                self.check_params(check, sizes, ("models", name, "checks", check))
            if (model.source == "generated") != bool(model.dir):
                self.add(("models", name), "a generated model names the folder that holds it (dir:), a downloaded "
                         "one does not")
            if (model.source == "huggingface") != bool(model.repo):
                self.add(("models", name), "a Hugging Face model names its repo (repo:), a generated one does not")
            for check, n in model.not_required.items():
                self.need(check, self.m.checks, "check", ("models", name, "not_required", check))
                for i, profile in enumerate(n.profiles):
                    self.need(profile, self.m.profiles, "profile", ("models", name, "not_required", check, "profiles", i))
            if model.stands_in_for:
                self.need(model.stands_in_for, self.m.models, "model", ("models", name, "stands_in_for"))
                if not model.dir:
                    self.add(("models", name, "stands_in_for"), "a stand-in is a folder of this repository (dir:)")

    def bases(self) -> None:
        for name, b in self.m.bases.items():
            if b.cuda_wheels and not b.debootstrap:
                self.add(("bases", name, "cuda_wheels"), "cuda_wheels go with debootstrap (a base made here)")

    def targets(self) -> None:
        m = self.m
        for name, t in m.targets.items():
            self.knobs(t.knobs, ("targets", name, "knobs"))
            for i, base in enumerate(t.bases):
                self.need(base, m.bases, "base", ("targets", name, "bases", i))
            for pkg, index in t.package_index.items():
                self.need(index, m.indexes, "index", ("targets", name, "package_index", pkg))
                self.need(pkg, m.pins, "pinned package", ("targets", name, "package_index", pkg))
            self.need(t.model, m.models, "model", ("targets", name, "model"))
            for i, pkg in enumerate(t.packages):
                self.need(pkg, m.pins, "pinned package", ("targets", name, "packages", i))
            for i, comp in enumerate(t.components):
                self.need(comp, m.components, "component", ("targets", name, "components", i))
            if "vllm" not in t.packages:
                self.add(("targets", name, "packages"), "a target must install vllm")

    def hosts(self) -> None:
        for name, h in self.m.hosts.items():
            if h.card is not None:
                self.need(h.card, self.m.cards, "card", ("hosts", name, "card"))
            self.knobs(h.knobs, ("hosts", name, "knobs"))
            for comp, table in h.component_knobs.items():
                self.knobs(table, ("hosts", name, "component_knobs", comp))
                self.need(comp, self.m.components, "component", ("hosts", name, "component_knobs", comp))
            for kv, table in h.batch.items():
                self.knobs(table, ("hosts", name, "batch", kv))
                for knob in set(table) - {"GPU_UTIL", "MAX_LEN"}:
                    self.add(("hosts", name, "batch", kv, knob), f"{knob}: the batch launcher takes GPU_UTIL and "
                             "MAX_LEN per KV from a host; set other knobs on the profile")

    def components(self) -> None:
        for name, component in self.m.components.items():
            for i, target in enumerate(component.targets):
                self.need(target, self.m.targets, "target", ("components", name, "targets", i))

    def profiles(self) -> None:
        m = self.m
        for name, p in m.profiles.items():
            loc = ("profiles", name)
            if not p.checks and not any(o and o.checks for o in p.targets.values()):
                self.add((*loc, "checks"), "a profile needs at least one check: a run of it must test something "
                         "before it can pass (or gate a release)")
            if not p.targets:
                self.add((*loc, "targets"), "a profile needs at least one target")
            self.knobs(p.knobs, (*loc, "knobs"))
            for host, table in p.hosts.items():
                self.need(host, m.hosts, "host", (*loc, "hosts", host))
                self.knobs(table, (*loc, "hosts", host))
            for host in p.source_budget:
                self.need(host, m.hosts, "host", (*loc, "source_budget", host))
            for check, params in p.checks.items():
                self.check_params(check, params, (*loc, "checks", check))
            for i, comp in enumerate(p.components):
                self.need(comp, m.components, "component", (*loc, "components", i))
            for target, override in p.targets.items():
                self.profile_target(name, target, override or ProfileTarget())

    def profile_target(self, name: str, target: str, override: ProfileTarget) -> None:
        loc = ("profiles", name, "targets", target)
        self.need(target, self.m.targets, "target", loc)
        self.knobs(override.knobs, (*loc, "knobs"))
        for check, params in override.checks.items():
            self.check_params(check, params, (*loc, "checks", check))
        listed = {**self.m.profiles[name].checks, **override.checks}
        for check, why in override.not_required.items():
            if check not in listed:
                self.add((*loc, "not_required", check), f"{check!r} is not a check of profile {name}; it lists "
                         f"{', '.join(listed)}")
            elif not why.strip():
                self.add((*loc, "not_required", check), "say why the check is not required here (the report shows it)")
