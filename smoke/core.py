"""The smoke checks' core: the context a check runs with, its result, the registry the `check` decorator fills,
parameter checking and the deadline each check runs under. The check modules import this, and the package's
`__init__` imports them (which registers their checks): one direction, no cycle."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args
from urllib.parse import urljoin, urlsplit

import requests

from servekit.image.boundary import number_in

MAX_REDIRECTS = 3  # within the server's own origin (a trailing slash); one to elsewhere fails the check
CHECK_DEADLINE_S = 600.0  # one check, all its requests: a hung, slow or endless server fails it by then
RUN_DEADLINE_S = 3600.0  # every check of one run
MAX_BODY_BYTES = 32 << 20  # the largest answer a check reads (a 64-prompt completion is well under 1 MiB)


Status = Literal["passed", "failed", "not_run", "not_required"]
STATUSES = get_args(Status)
GATE_PASSES = ("passed", "not_required")  # a required check that did not run fails the gate


def all_passed(statuses: Iterable[str]) -> bool:
    """The one rule for a run, a sweep's boot, a smoke command and the release gate."""
    return all(status in GATE_PASSES for status in statuses)


@dataclass
class Result:
    """A check's verdict: the one type, from the check to the report on disk (servekit's RunReport holds these)."""
    __pydantic_config__ = {"extra": "forbid"}  # a report of another shape is refused where it is read

    name: str
    status: Status
    reason: str = ""
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Context:
    url: str
    api_key: str
    model: str  # the served model name the profile expects
    gpu: bool = False  # whether the target has a GPU (a GPU-only check does not run otherwise)
    logs: Callable[[], list[str]] | None = None  # the server's log lines, when known
    environ: Callable[[], dict[str, str]] | None = None  # the serving process's environment, when it can be read
    healthy_line: int = 0  # index of the first log line after the server became healthy
    # WSL2 only: ends the traffic and gives the run's Shared Usage figures (None where it was not sampled)
    shared_usage: Callable[[], dict | None] | None = None
    timeout_s: float = 300  # how long one request may wait between bytes
    check_deadline_s: float = CHECK_DEADLINE_S
    deadline_scales: bool = True  # a check of many requests gets its DEADLINE_FACTORS times it (not under --timeout)
    max_body_bytes: int = MAX_BODY_BYTES

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def fetch(self, method: str, path: str, session: requests.Session | None = None, keyless: bool = False,
              **kw: Any) -> requests.Response:
        """One request whose body is read in pieces and refused past max_body_bytes (a server cannot make the
        checks hold its answer in memory); the check's deadline bounds the whole of it (run_check). A redirect is
        followed only within the server's own origin: the checks judge this server, never where it sends them."""
        headers = {} if keyless else self.headers()
        url = f"{self.url}{path}"
        for _ in range(MAX_REDIRECTS + 1):
            resp = (session or requests).request(method, url, headers=headers, stream=True, allow_redirects=False,
                                                 timeout=(10, self.timeout_s), **kw)
            if not resp.is_redirect:
                break
            resp.close()
            url = urljoin(url, resp.headers.get("Location", ""))
            if _origin(url) != _origin(self.url):
                raise CheckFailure(f"{method} {path}: the server redirected to {_origin(url)}, another origin than "
                                   f"{_origin(self.url)}; the checks judge the server itself")
        else:
            raise CheckFailure(f"{method} {path}: more than {MAX_REDIRECTS} redirects")
        body, size = [], 0
        with resp:
            for piece in resp.iter_content(64 << 10):
                size += len(piece)
                if size > self.max_body_bytes:
                    raise CheckFailure(f"{method} {path}: the response passed {self.max_body_bytes >> 20} MiB; "
                                       "not read further")
                body.append(piece)
        # read: .json() and .text work on it (requests keeps the body in these two, which its stubs do not name)
        resp._content, resp._content_consumed = b"".join(body), True  # type: ignore[union-attr]
        return resp

    def post(self, path: str, body: dict, session: requests.Session | None = None) -> requests.Response:
        return self.fetch("POST", path, session=session, json=body)

    def metrics(self) -> list:
        """/metrics as Prometheus samples (name, labels, value), read by Prometheus' own text parser."""
        return metric_samples(self.fetch("GET", "/metrics").text)

    def metric_totals(self, names: Iterable[str]) -> dict[str, float]:
        """Each sample named in `names` that /metrics has, summed over its labels (engines, models)."""
        return totals(self.metrics(), names)

    def chat(self, messages: list[dict], *, session: requests.Session | None = None, **kw: Any) -> dict:
        resp = self.post("/v1/chat/completions", {"model": self.model, "messages": messages, **kw}, session=session)
        resp.raise_for_status()
        return resp.json()

    def answer(self, messages: list[dict], **kw: Any) -> str:
        """The first choice's text: its content, else what the reasoning parser took (content is null when an
        answer never closed its thinking), else ""."""
        message = self.chat(messages, **kw)["choices"][0]["message"]
        return text_of(message) or reasoning_of(message)


def metric_samples(text: str) -> list:
    """The samples of a Prometheus text exposition; CheckFailure when it is not one."""
    try:
        from prometheus_client.parser import text_string_to_metric_families  # the host tool's: the image imports
        # the checks' prompts (bench/gpu/qwen35_mini.py) without it
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except (ValueError, TypeError, IndexError) as exc:  # the parser's words for text that is no exposition
        raise CheckFailure(f"/metrics is not Prometheus' text format ({exc})") from None


def stream_events(body: bytes) -> list[str]:
    """The data of each server-sent event of a streamed answer, in order, read by a kept SSE parser (events that
    span lines or pieces, comments, CRLF: as the format defines them)."""
    try:
        from sseclient import SSEClient  # the host tool's, as prometheus_client above
        return [event.data for event in SSEClient(iter([body])).events()]
    except UnicodeDecodeError as exc:
        raise CheckFailure(f"the stream is not UTF-8 text ({exc})") from None


def totals(samples: Iterable[Any], names: Iterable[str]) -> dict[str, float]:
    wanted, out = set(names), dict[str, float]()
    for sample in samples:
        if sample.name in wanted:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def text_of(message: dict) -> str:
    """A chat message's content, "" where the reasoning parser left it null."""
    return message.get("content") or ""


def reasoning_of(message: dict) -> str:
    """What the reasoning parser took of a chat message (vLLM names it reasoning_content, newer ones reasoning)."""
    return message.get("reasoning_content") or message.get("reasoning") or ""


class CheckFailure(Exception):
    """Raised inside a check: the check failed for the reason given."""

    def __init__(self, reason: str, **figures: Any) -> None:
        super().__init__(reason)
        self.figures = figures


class NotRun(Exception):
    """Raised inside a check: it could not measure here; the reason says why. Never a pass."""


CheckFunction = Callable[..., dict | None]  # a check: (ctx, its parameters) -> its figures
CHECKS: dict[str, tuple[CheckFunction, bool]] = {}  # name -> (function, gpu_only)
AFTER_TRAFFIC = ("spill",)  # checks that judge the traffic the others sent: run last, in this order
# name -> parameter -> (least, most): a numeric parameter not named here must be at least 1, so that no
# configuration makes a check do nothing (seeds: 0) and pass.
BOUNDS: dict[str, dict[str, tuple[float, float | None]]] = {}
DEADLINE_FACTORS: dict[str, float] = {}  # name -> its deadline in check deadlines, for a check of many requests


def check(name: str, gpu_only: bool = False, bounds: dict[str, tuple[float, float | None]] | None = None,
          deadline_factor: float = 1.0) -> Callable[[CheckFunction], CheckFunction]:
    def register(func: CheckFunction) -> CheckFunction:
        CHECKS[name] = (func, gpu_only)
        BOUNDS[name] = bounds or {}
        DEADLINE_FACTORS[name] = deadline_factor
        return func
    return register


def param_problems(name: str, params: dict) -> list[str]:
    """Why `params` do not fit check `name`'s implementation: an unknown parameter, or a value of
    another type than the parameter's default (an int where a float is expected is fine)."""
    if name not in CHECKS:
        return [f"no check named {name!r} is implemented; expected one of {', '.join(sorted(CHECKS))}"]
    signature = inspect.signature(CHECKS[name][0])
    accepted = {p.name: p.default for p in list(signature.parameters.values())[1:]}
    problems = []
    for key, value in params.items():
        if key not in accepted:
            problems.append(f"check {name} takes no parameter {key!r}; it takes {', '.join(accepted) or 'none'}")
            continue
        default = accepted[key]
        fits = (isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool))
                or (isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)))
        if not fits:
            problems.append(f"check {name}: {key}={value!r} should be {type(default).__name__}, like its default "
                            f"{default!r}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            least, most = BOUNDS[name].get(key, (1, None))
            if number_in(value, least, most):  # (an int past what a float holds compares without converting)
                problems.append(f"check {name}: {key}={repr(value)[:40]} is out of range: at least {least:g}"
                                + (f" and at most {most:g}" if most is not None else ""))
    return problems


def _verdict(name: str, func: Callable, ctx: Context, params: dict) -> Result:
    try:
        figures = func(ctx, **params)
        return (Result(name, "passed", "", figures) if figures else
                Result(name, "failed", "the check did no work: it reported no figures"))
    except CheckFailure as exc:
        return Result(name, "failed", str(exc), exc.figures)
    except NotRun as exc:
        return Result(name, "not_run", str(exc))
    except requests.RequestException as exc:
        return Result(name, "failed", f"request failed: {type(exc).__name__}: {str(exc)[:200]}")
    except Exception as exc:  # a bug in the check, or an answer of a shape it did not expect: said, never hidden
        return Result(name, "failed", f"the check itself broke: {type(exc).__name__}: {str(exc)[:200]}")


def run_check(name: str, ctx: Context, params: dict, deadline_s: float | None = None) -> Result:
    """The check's verdict within its deadline (the context's, or less when the run has less left): a server
    that never answers, trickles or streams without end fails it then, named as such."""
    func, gpu_only = CHECKS[name]
    started = time.monotonic()
    if gpu_only and not ctx.gpu:
        return Result(name, "not_run", "needs a GPU target (images.yaml can mark it not required on this target)")
    own = ctx.check_deadline_s * (DEADLINE_FACTORS.get(name, 1.0) if ctx.deadline_scales else 1.0)
    limit = min(own, deadline_s if deadline_s is not None else own)
    box: list[Result] = []
    # A daemon thread: a request stuck in a read cannot be interrupted, but it no longer holds the run.
    worker = threading.Thread(target=lambda: box.append(_verdict(name, func, ctx, params)), daemon=True,
                              name=f"check-{name}")
    worker.start()
    worker.join(max(limit, 0.0))
    result = box[0] if box else Result(name, "failed", f"no verdict within {limit:.0f} s: the server is hung, too "
                                       "slow or sends without end")
    result.seconds = round(time.monotonic() - started, 2)
    return result


def ensure(condition: bool, reason: str, **figures: Any) -> None:
    if not condition:
        raise CheckFailure(reason, **figures)

