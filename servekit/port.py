"""Keeping the series alive across vLLM releases: what each patch's trailers say against a vLLM pin.

`Cut-against` names the vLLM a patch was cut against (stale when it is not the pin), `Retires-when` may name the
vLLM release that makes a patch unneeded (then the pin, or a new one, retires it). (`Supersedes` is checked where
the series is read: a patch and the one it replaces are never both in it.)
"""

from __future__ import annotations

import re

from packaging.version import InvalidVersion, Version

from .image.series import Patch
from .pins import Findings

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
