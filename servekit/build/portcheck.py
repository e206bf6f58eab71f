"""`port --to X`: will the series survive a move to vLLM X? Answered from the two pristine wheels alone.

Three checks, each printing its findings and one summary line, as the source's port scripts do:
- removed names: an identifier (4+ characters) that the old tree has and the new does not, used by a line our
  series adds (names the series defines itself excepted);
- changed signatures: a call made on a line our series adds that no longer binds to its target's signature in the
  new tree (positional count, keyword names, required and keyword-only parameters), with the series' own
  definitions laid over the new tree; bare names, module functions, `Class(...)`, `Class.method` and
  `self.`/`cls.` methods through the class and its bases are resolved, other calls skipped;
- applies: each patch against the new tree at fuzz 0, in order, and at what offsets.
Beside them, what each patch's trailers say against a vLLM pin (`verify`, `bump`): `Cut-against` names the vLLM a
patch was cut against, `Retires-when` may name the release that retires it. (`Supersedes` is checked where the
series is read: a patch and the one it replaces are never both in it.)
`--accept NAME=REASON` records a reviewed exception in the series folder (`port-accept`), where the next port sees it.
"""

from __future__ import annotations

import ast
import difflib
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from servekit.build.findings import Findings
from servekit.build.index import download_wheel
from servekit.config.session import Session
from servekit.errors import UserError
from servekit.image.boundary import write_text_atomic
from servekit.image.series import PATCH_ARGS, Patch, SeriesError, apply_series, read_series, run_patch
from servekit.output import Say

IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
DEFINES = (re.compile(r"^\s*(?:async\s+)?def\s+(\w+)"), re.compile(r"^\s*class\s+(\w+)"),
           re.compile(r"^\s*(?:self\.)?(\w+)\s*(?::[^=]+)?=(?!=)"), re.compile(r"^\s*\*{0,2}(\w+)\s*(?::[^=,]+)?(?:=[^,]*)?,?\s*$"))
ACCEPT_FILE = "port-accept"
FINDINGS = ("REMOVED", "BREAKS", "FAILS", "SYNTAX")  # what fails a port unless accepted
MAX_DEPTH = 6


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)  # findings (REMOVED, BREAKS, FAILS, SYNTAX, moved, accepted)
    summaries: list[str] = field(default_factory=list)
    failures: int = 0


def extract(wheel: Path, dest: Path, also: set[str] | None = None) -> Path:
    """The wheel's `vllm/` Python files (and the files in `also`, relative to vllm/) under dest; the package folder."""
    try:
        with zipfile.ZipFile(wheel) as whl:
            whl.extractall(dest, [m for m in whl.namelist() if m.startswith("vllm/") and (
                m.endswith(".py") or m[len("vllm/"):] in (also or set()))])
    except (zipfile.BadZipFile, OSError) as exc:  # cut short, another file under a wheel's name
        raise UserError(f"{wheel}: not a readable wheel ({exc}); remove it and fetch it again") from None
    return dest / "vllm"


def read_accepted(series_dir: Path) -> dict[str, str]:
    path = series_dir / ACCEPT_FILE
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):  # a comment line; a reason may cite "vllm #58092"
            continue
        name, sep, reason = line.strip().partition("=")
        if sep and name.strip():
            out[name.strip()] = reason.strip()
    return out


def record_accepted(series_dir: Path, accepted: dict[str, str]) -> None:
    """Add NAME=REASON lines to the series' accept file (kept with the series, read by the next port): a name it
    already holds gets the new reason in its place, every other line (a reviewer's comment too) stays as it was."""
    path = series_dir / ACCEPT_FILE
    lines = path.read_text().splitlines() if path.is_file() else \
        ["# Reviewed exceptions of `python3 build.py port`: NAME=REASON a line."]
    left = dict(accepted)
    for i, line in enumerate(lines):
        name = line.partition("=")[0].strip()
        if not line.lstrip().startswith("#") and name in left:
            lines[i] = f"{name}={left.pop(name)}"
    write_text_atomic(path, "\n".join(lines + [f"{name}={reason}" for name, reason in left.items()]) + "\n", mode=0o644)


def _strip_comment(code: str) -> str:
    return re.sub(r"#.*$", "", code)


def added_lines(tree: Path, pristine: Path) -> dict[str, dict[int, str]]:
    """file (relative to vllm/) -> {line in the patched file: text} of every line the series adds."""
    out: dict[str, dict[int, str]] = {}
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(tree).as_posix()
        old = (pristine / rel).read_text(errors="replace").splitlines() if (pristine / rel).is_file() else []
        new = path.read_text(errors="replace").splitlines()
        if old == new:
            continue
        added = {}
        for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag in ("insert", "replace"):
                added.update({j + 1: new[j] for j in range(j1, j2)})
        if added:
            out[rel] = added
    return out


def _owner(patches: list[Patch], rel: str, text: str) -> str:
    """The patch that adds this line (the first whose hunks for the file carry it)."""
    for patch in patches:
        if rel in patch.files and f"\n+{text}\n" in "\n" + patch.path.read_text() + "\n":
            return patch.name
    return "?"


def removed_names(old: Path, new: Path, added: dict[str, dict[int, str]], patches: list[Patch],
                  accepted: dict[str, str], versions: str) -> Report:
    def names(tree: Path) -> set[str]:
        return {n for p in tree.rglob("*.py") for n in IDENTIFIER.findall(p.read_text(errors="replace"))}
    removed = names(old) - names(new)
    ours = {m[1] for lines in added.values() for text in lines.values() for rx in DEFINES if (m := rx.match(text))}
    out = Report()
    using = 0
    for rel, lines in added.items():
        for number, text in lines.items():
            hit = sorted((set(IDENTIFIER.findall(_strip_comment(text))) & removed) - ours)
            if not hit:
                continue
            if all(name in accepted for name in hit):
                out.lines.append(f"accepted {rel}:{number}: {', '.join(hit)} ({'; '.join(accepted[n] for n in hit)})")
                continue
            using += 1
            out.lines.append(f"REMOVED  {_owner(patches, rel, text)[:60]}  {rel}:{number}: {', '.join(hit)}  |  "
                             f"{text.strip()[:100]}")
    out.failures = using
    out.summaries.append(f"port-removed-names {versions}: {len(removed)} names removed upstream, "
                         f"{len(removed & ours)} of them redefined by the series; {using} added line(s) of ours use one")
    return out


# --- trailers ---------------------------------------------------------------------------------------------------


VERSION = re.compile(r"(?<![\w.])v?(\d+\.\d+\.\d+(?:rc\d+|\.post\d+)?)(?![\w.])")


def _version(text: str) -> Version | None:
    found = VERSION.search(text)
    try:
        return Version(found[1]) if found else None
    except InvalidVersion:
        return None


def trailer_findings(patches: list[Patch], pin: str) -> Findings:
    """Problems (a Cut-against without a version) and notes (a patch cut against another vLLM, one that the pin
    retires) of the series against the vLLM `pin`."""
    out = Findings()
    pinned = Version(pin)
    for patch in patches:
        cut = _version(patch.trailers["Cut-against"])
        if cut is None:
            out.problems.append(f"{patch.name}: Cut-against: {patch.trailers['Cut-against']!r} names no vLLM "
                                f"version; write the one it was cut against, e.g. {pin}")
        elif cut != pinned:
            out.notes.append(f"{patch.name}: cut against vLLM {cut}, the pin is {pin}: re-cut it and set Cut-against "
                             f"(the series proof on the pristine {pin} wheel says whether it still applies)")
        retires = _version(patch.trailers.get("Retires-when", ""))
        if retires is not None and pinned >= retires:
            out.notes.append(f"{patch.name}: retire this patch: Retires-when names vLLM {retires}, and the pin "
                             f"{pin} contains it ({patch.trailers['Retires-when']})")
    return out


# --- signatures ------------------------------------------------------------------------------------------------


@dataclass
class Module:
    defs: dict[str, ast.AST]  # top-level functions and classes
    imports: dict[str, tuple[str, str | None]]  # alias -> (module, name or None for the module itself)


def _module(path: Path) -> Module | None:
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return None
    defs: dict[str, ast.AST] = {}
    imports: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                imports[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    imports[alias.asname] = (alias.name, None)
    return Module(defs, imports)


class Resolver:
    """Definitions of a tree of vllm/, each module parsed once, with the series' modules laid over: their own
    definitions (functions and classes whose definition line the series adds) and their imports."""

    def __init__(self, root: Path, series: dict[str, Module] | None = None, own: set[int] | None = None) -> None:
        self.root, self.series, self.own = root, series or {}, own or set()
        self.cache: dict[str, Module | None] = {}

    def module(self, dotted: str) -> Module | None:
        if dotted not in self.cache:
            rel = dotted.split(".", 1)[1].replace(".", "/") if "." in dotted else ""
            path = next((p for p in (self.root / f"{rel}.py", self.root / rel / "__init__.py") if p.is_file()), None)
            found = _module(path) if path else None
            ours = self.series.get(dotted)
            if ours is not None:
                found = found or Module({}, {})
                found.defs.update({n: d for n, d in ours.defs.items() if id(d) in self.own})
                found.imports.update(ours.imports)
            self.cache[dotted] = found
        return self.cache[dotted]

    def name(self, dotted: str, name: str, depth: int = 0) -> ast.AST | None:
        mod = self.module(dotted)
        if mod is None or depth > MAX_DEPTH:
            return None
        if name in mod.defs:
            return mod.defs[name]
        if name in mod.imports and mod.imports[name][0].startswith("vllm") and mod.imports[name][1]:
            source, real = mod.imports[name]
            return self.name(source, str(real), depth + 1)
        return None

    def method(self, dotted: str, cls: ast.ClassDef, name: str, depth: int = 0) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        ours = self.series.get(dotted)
        mine = ours.defs.get(cls.name) if ours else None
        for node in getattr(mine, "body", []):  # a method the series adds to a class that was there
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name and id(node) in self.own:
                return node
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        if depth >= MAX_DEPTH:
            return None
        for base in cls.bases:
            if isinstance(base, ast.Name):
                parent = self.name(dotted, base.id)
                if isinstance(parent, ast.ClassDef):
                    found = self.method(self._home(dotted, base.id), parent, name, depth + 1)
                    if found is not None:
                        return found
        return None

    def _home(self, dotted: str, name: str) -> str:
        """The module a name used in `dotted` is defined in (for resolving that definition's own bases)."""
        mod = self.module(dotted)
        if mod and name not in mod.defs and name in mod.imports:
            return mod.imports[name][0]
        return dotted


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool) -> str:
    text = ast.unparse(fn.args)
    return text.split(",", 1)[1].strip() if bound and "," in text else ("" if bound else text)


def binds(fn: ast.FunctionDef | ast.AsyncFunctionDef, bound: bool, positional: int, keywords: list[str]) -> str | None:
    """Why a call with `positional` arguments and these keywords does not bind to fn; None when it does."""
    a = fn.args
    params = [*a.posonlyargs, *a.args][1 if bound else 0:]
    posonly = {p.arg for p in a.posonlyargs}
    if positional > len(params) and a.vararg is None:
        return f"{positional} positional, it takes {len(params)}"
    named = {p.arg for p in params if p.arg not in posonly} | {p.arg for p in a.kwonlyargs}
    for kw in keywords:
        if kw not in named and a.kwarg is None:
            return f"no parameter {kw}"
        if kw in {p.arg for p in params[:positional]}:
            return f"{kw} given twice"
    defaults = len(a.defaults)
    required = [p.arg for p in params[:len(params) - defaults]] if defaults else [p.arg for p in params]
    missing = [r for r in required[positional:] if r not in keywords]
    missing += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None and p.arg not in keywords]
    return f"missing {', '.join(missing)}" if missing else None


def _is_static(fn: ast.AST) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in getattr(fn, "decorator_list", []))


def changed_signatures(old: Path, new: Path, patched: Path, added: dict[str, dict[int, str]], patches: list[Patch],
                       accepted: dict[str, str], versions: str) -> Report:
    """Each call on an added line, bound against the new tree (with the series' own definitions over it)."""
    series: dict[str, Module] = {}
    own: set[int] = set()  # the functions and classes whose definition line the series adds
    for rel, lines in added.items():
        mod = _module(patched / rel)
        if mod:
            series["vllm." + rel[:-3].replace("/", ".").removesuffix(".__init__")] = mod
            for top in mod.defs.values():
                own |= {id(n) for n in ast.walk(top) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                       ast.ClassDef)) and n.lineno in lines}
    newer, older = Resolver(new, series, own), Resolver(old, series, own)
    out = Report()
    resolved = skipped = 0
    for rel, lines in added.items():
        dotted = "vllm." + rel[:-3].replace("/", ".").removesuffix(".__init__")
        try:
            tree = ast.parse((patched / rel).read_text(errors="replace"))
        except SyntaxError as exc:
            out.lines.append(f"SYNTAX   {rel}:{exc.lineno}: {exc.msg}")
            out.failures += 1
            continue
        classes = {n: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in ast.walk(c)}
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno in lines):
            if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
                skipped += 1
                continue
            target = _callee(call, dotted, classes.get(call), newer)
            if target is None:
                skipped += 1
                continue
            fn, bound, label = target
            resolved += 1
            keywords = [str(k.arg) for k in call.keywords]
            why = binds(fn, bound, len(call.args), keywords)
            if why is None:
                continue
            reason = accepted.get(label) or accepted.get(label.split(".")[-1])
            if reason:
                out.lines.append(f"accepted {rel}:{call.lineno}: {label} ({reason})")
                continue
            before = _callee(call, dotted, classes.get(call), older)
            if id(fn) in own:
                history = "the series' own definition"
            elif before is None or _signature(before[0], before[1]) != _signature(fn, bound):
                history = "changed"
            else:
                history = "same in both"
            out.failures += 1
            out.lines.append(f"BREAKS   {_owner(patches, rel, lines[call.lineno])[:50]}  {rel}:{call.lineno}: {label}("
                             f"{len(call.args)} positional{', ' if keywords else ''}{', '.join(keywords)})  [{history}]: "
                             f"{why}; takes ({_signature(fn, bound)})")
    out.summaries.append(f"port-changed-signatures {versions}: {resolved} resolved calls on added lines in "
                         f"{len(added)} files bound against the new tree; {skipped} skipped; {out.failures} BREAKS")
    return out


def _callee(call: ast.Call, dotted: str, cls: ast.ClassDef | None,
            resolver: Resolver) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool, str] | None:
    """(the function, whether its first parameter is bound, a label) a call reaches, or None."""
    func = call.func
    node: ast.AST | None = None
    if isinstance(func, ast.Name):
        node, label = resolver.name(dotted, func.id), func.id
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner, label = func.value.id, f"{func.value.id}.{func.attr}"
        if owner in ("self", "cls") and cls is not None:
            home = resolver.name(dotted, cls.name)
            node = resolver.method(dotted, home if isinstance(home, ast.ClassDef) else cls, func.attr)
            if node is not None and not _is_static(node):
                return node, True, label
        else:
            mod = resolver.module(dotted)
            target = mod.imports.get(owner) if mod else None
            if target and target[1] is None and target[0].startswith("vllm"):
                node = resolver.name(target[0], func.attr)
            else:
                holder = resolver.name(dotted, owner)
                if isinstance(holder, ast.ClassDef):
                    node = resolver.method(dotted, holder, func.attr)
                    if node is not None:
                        bound = any(isinstance(d, ast.Name) and d.id == "classmethod"
                                    for d in getattr(node, "decorator_list", []))
                        return node, bound, label
    else:
        return None
    if isinstance(node, ast.ClassDef):
        init = resolver.method(dotted, node, "__init__")
        return (init, True, f"{label}.__init__") if init is not None else None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node, False, label
    return None


# --- applying to the new tree ----------------------------------------------------------------------------------


def applies(series_dir: Path, new: Path, target: str, versions: str) -> Report:
    out = Report()
    moved = 0
    for patch in read_series(series_dir):
        if not patch.applies_to(target):
            continue
        done = run_patch(PATCH_ARGS, patch.path, new)
        offsets = re.findall(r"^Hunk #\d+ succeeded at \d+ \(offset (-?\d+) lines?\)", done.stdout, re.M)
        if done.returncode != 0:
            out.failures += 1
            out.lines.append(f"FAILS    {patch.name}: does not apply at fuzz 0; re-cut it against the new tree")
        elif offsets:
            moved += 1
            out.lines.append(f"moved    {patch.name}: {len(offsets)} hunk(s) at an offset ({', '.join(offsets)} lines)")
        else:
            out.lines.append(f"applies  {patch.name}: every hunk where it was")
    out.summaries.append(f"port-applies {versions}: {out.failures} of the series fail at fuzz 0, {moved} apply at an "
                         "offset")
    return out


def port(series_dir: Path, old_wheel: Path, new_wheel: Path, target: str, old: str, new: str,
         accepted: dict[str, str]) -> Report:
    """Every check of moving the series from the vLLM of old_wheel to that of new_wheel."""
    versions = f"{old} -> {new}"
    with tempfile.TemporaryDirectory(prefix="servekit-port-") as tmp:
        named = {f for p in read_series(series_dir) for f in p.files}  # a patch may touch a file that is not Python
        old_tree, new_tree = extract(old_wheel, Path(tmp) / "old", named), extract(new_wheel, Path(tmp) / "new", named)
        patched = Path(tmp) / "patched" / "vllm"
        shutil.copytree(old_tree, patched)
        apply_series(series_dir, patched, target, say=lambda line: None)
        patches = [p for p in read_series(series_dir) if p.applies_to(target)]
        added = added_lines(patched, old_tree)
        report = Report()
        for part in (removed_names(old_tree, new_tree, added, patches, accepted, versions),
                     changed_signatures(old_tree, new_tree, patched, added, patches, accepted, versions),
                     applies(series_dir, new_tree, target, versions)):
            report.lines += part.lines
            report.summaries += part.summaries
            report.failures += part.failures
        return report


def run_port(session: Session, to: str, targets: list[str] | None = None, accept: dict[str, str] | None = None,
             say: Say = print) -> Report:
    """`port --to X`: the checks for each target (all when none is named) between the pinned vLLM and X, from the
    pristine wheels (downloaded once into .cache/pristine). `accept` is recorded in the series first."""
    matrix = session.matrix
    series_dir = session.root / matrix.series.dir
    if accept:
        record_accepted(series_dir, accept)
    accepted = read_accepted(series_dir)
    report = Report()
    for target in targets or list(matrix.targets):
        dist = matrix.targets[target].vllm_distribution
        wheels = []
        for version in (matrix.vllm, to):
            say(f"port: the pristine {dist} {version} wheel (downloaded once into .cache/pristine)")
            wheels.append(download_wheel(dist, version, matrix.indexes["pypi"].url, session.cache / "pristine"))
        try:
            part = port(series_dir, wheels[0], wheels[1], target, matrix.vllm, to, accepted)
        except SeriesError as exc:  # the series does not even apply to the pinned vLLM: verify says more
            raise UserError(f"series on vLLM {matrix.vllm} ({target}): {exc}") from None
        report.lines += [f"{target}: {line}" for line in part.lines + part.summaries]  # read in this order
        report.summaries += [f"{target}: {line}" for line in part.summaries]
        report.failures += part.failures
    return report
