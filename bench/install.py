"""
Benchmark of installing engines through the API (protocol.md section 10), run by hand
(`.venv/bin/python bench/install.py [--rounds N] [--only install,speak,child]`).

Three figures, as issue 14's "Performance" asks:

1. C{install}: espeak installed from the checkout's C{engines/} by the core's own
   L{Installer}, driven in this process on a real reactor (a host that records the
   register, a real L{Commands}, a real state database in a temporary file, a fresh
   C{install.venvDir}), once with uv (L{find_uv}) and once with the interpreter's
   C{venv} and pip, alternating, after one untimed run of each to warm pip's and uv's
   caches.  Wall time from submit to the job's end, and each step from the job's
   progress events' C{ts}.
2. C{speak}: a real core (C{rhapsode serve}) with tone resident: time to first byte of
   a short streamed /speak on one kept-alive connection, idle (before and after) and
   while C{POST /engines/espeak/install} runs; p50/p90/p99/max and the ratio of p99s.
   In the same install, a subscriber of C{GET /installs/{job}/events} over loopback:
   each log event's receipt against its C{ts} (the core's reactor clock, wall time),
   which is the core's receipt of the line to the subscriber.
3. C{child}: the other half of an event's way, in process: L{Commands.run} on a child
   that prints C{time.time()} on each of 200 lines, 10 ms apart, each stamp against
   the moment its line was appended to the job's events.

The sum of the two event figures is the line printed to the subscriber.  Asserts
nothing; everything shares this machine's cores with the clients and the installs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from _common import KeptAlive, free_port, percentile, request_bytes, tcp, wait_listening
from twisted.internet.defer import Deferred, succeed

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "espeak"
SENTENCE = "The quick brown fox jumps over the lazy dog."
IDLE_SAMPLES = 300
CHILD_LINES = 200
_T = TypeVar("_T")


def epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def figures(values: list[float]) -> str:
    if not values:
        return "no samples"
    return (f"p50 {percentile(values, 0.5) * 1e3:7.2f}  p90 {percentile(values, 0.9) * 1e3:7.2f}  "
            f"p99 {percentile(values, 0.99) * 1e3:7.2f}  max {max(values) * 1e3:7.2f} ms  (n={len(values)})")


# -- 1 and 3: the installer in this process ---------------------------------------------


class RecordingHost:
    """
    The installer's EngineHost with no registry behind it: register is recorded, and
    quiet runs the work at once.
    """

    def __init__(self) -> None:
        self.declared: list[str] = []

    def registered(self, engine_id: str) -> bool:
        return False

    def operator_engines(self) -> set[str]:
        return set()

    def declare(self, engine_id: str, entry: Mapping[str, Any]) -> None:
        self.declared.append(engine_id)

    def retire(self, engine_id: str) -> "Deferred[None]":
        return succeed(None)

    def replace(self, engine_id: str, entry: Mapping[str, Any]) -> "Deferred[None]":
        return succeed(None)

    async def quiet(self, engine_id: str, work: Callable[[], Awaitable[_T]], wait: float | None) -> _T:
        return await work()

    async def fetch(self, engine_id: str, variant: str, context: Any, required: bool = True) -> None:
        return None


async def install_once(reactor: Any, tmp: Path, uv: str | None) -> dict[str, Any]:
    """
    One install of espeak into a fresh venvDir; its wall time and steps.
    """
    from rhapsode import __version__
    from rhapsode._fleet.catalog import Catalog, read_source
    from rhapsode._manage.installer import Commands, Installer
    from rhapsode._manage.jobs import Jobs
    from rhapsode._manage.state import StateDatabase, StateStore

    work = Path(tempfile.mkdtemp(dir=tmp))
    store = StateStore.open(work / "rhapsode.db", __version__)
    state = StateDatabase(store, reactor)
    jobs = Jobs(reactor)
    host = RecordingHost()
    installer = Installer(
        reactor=reactor, jobs=jobs, catalog=Catalog(read_source(ROOT / "engines"), __version__), state=state,
        host=host, venv_dir=lambda: work / "venvs", source_dir=lambda: ROOT / "engines", interpreter=lambda: None,
        runner=Commands(reactor, os.environ), environ=os.environ, core_version=__version__, uv=uv,
    )
    ended: Deferred[Any] = Deferred()
    jobs.on_finished = ended.callback
    started = time.monotonic()
    job = installer.install(ENGINE, None, None)
    await ended
    wall = time.monotonic() - started
    _, frames = job.events.after(0)
    events = [json.loads(frame.decode().split("data: ", 1)[1]) for _, frame in frames]
    marks = [(e["progress"]["phase"], e["progress"]["status"], epoch(e["ts"])) for e in events if e["kind"] == "progress"]
    steps: dict[str, float] = {}
    for (phase, _, at), (_, _, following) in zip(marks, marks[1:]):
        steps[phase] = following - at
    # Each command, from its "$ ..." line to the next command or step.
    bounds = [(epoch(e["ts"]), e["message"] if e["kind"] == "log" else None) for e in events
              if e["kind"] == "progress" or (e["kind"] == "log" and e["message"].startswith("$ "))]
    for (at, command), (following, _) in zip(bounds, bounds[1:]):
        if command is not None:
            name = ("upgrade pip" if "--upgrade pip" in command else "pip install" if " -m pip install" in command
                    else None)
            if name is not None:
                steps[name] = following - at
    result = {"wall": wall, "state": job.state, "steps": steps, "lines": sum(e["kind"] == "log" for e in events),
              "error": (job.error or {}).get("message"), "declared": host.declared}
    state.close()
    shutil.rmtree(work, ignore_errors=True)
    return result


async def install_figures(reactor: Any, tmp: Path, rounds: int) -> None:
    from rhapsode._manage.installer import find_uv

    uv = find_uv()
    if uv is None:
        print("install: no uv here (find_uv found none); only pip is timed")
    kinds = [("uv", uv), ("pip", None)] if uv else [("pip", None)]
    for name, tool in kinds:
        warm = await install_once(reactor, tmp, tool)
        print(f"install {ENGINE}, {name}, untimed warm-up: {warm['state']} in {warm['wall']:.1f} s"
              + (f" ({warm['error']})" if warm["error"] else ""))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in kinds}
    for round_ in range(rounds):
        order = kinds if round_ % 2 == 0 else kinds[::-1]
        for name, tool in order:
            result = await install_once(reactor, tmp, tool)
            results[name].append(result)
            steps = "  ".join(f"{step} {seconds:5.2f}" for step, seconds in result["steps"].items())
            print(f"  round {round_ + 1} {name:<3}: {result['state']} {result['wall']:6.2f} s  [{steps}]"
                  f"  {result['lines']} log lines" + (f"  ({result['error']})" if result["error"] else ""))
    print(f"install {ENGINE} from the checkout, venv+packages+verify+register, {rounds} rounds alternating (s):")
    columns = ("venv", "packages", "upgrade pip", "pip install", "verify", "register")
    print(f"  {'':<4} {'wall':>14} " + " ".join(f"{c:>14}" for c in columns))
    for name, _ in kinds:
        done = [r for r in results[name] if r["state"] == "succeeded"]
        if not done:
            print(f"  {name:<4} no successful install")
            continue

        def spread(values: list[float]) -> str:
            if not values:
                return "-"
            values = sorted(values)
            return f"{values[len(values) // 2]:6.2f} ({values[0]:.1f}-{values[-1]:.1f})"

        cols = [spread([r["wall"] for r in done])]
        for step in columns:
            cols.append(spread([r["steps"][step] for r in done if step in r["steps"]]))
        print(f"  {name:<4} " + " ".join(f"{c:>14}" for c in cols))
    print("  (median, and min-max over the rounds; packages is upgrade pip + pip install; register is the state\n"
          "   database write and the host's declare; uv makes the venv only, pip installs the packages either way)")


CHILD = (
    "import sys, time\n"
    "for i in range({n}):\n"
    "    print(repr(time.time()), flush=True)\n"
    "    time.sleep(0.01)\n"
)


async def child_figures(reactor: Any) -> list[float]:
    """
    Each of the child's lines: from its print to its event being appended.
    """
    from rhapsode._manage.installer import Commands
    from rhapsode._manage.jobs import EventLog, JobContext, Jobs

    arrivals: list[tuple[float, str]] = []
    original = EventLog.append

    def append(self: EventLog, kind: str, message: str, **kwargs: Any) -> dict[str, Any]:
        if kind == "log":
            arrivals.append((time.time(), message))
        return original(self, kind, message, **kwargs)

    EventLog.append = append  # type: ignore[method-assign]
    try:
        jobs = Jobs(reactor)
        runner = Commands(reactor, os.environ)
        ended: Deferred[Any] = Deferred()
        jobs.on_finished = ended.callback

        async def work(context: JobContext) -> None:
            context.step("weights")
            await runner.run(context, [sys.executable, "-u", "-c", CHILD.format(n=CHILD_LINES)])

        job = jobs.submit("child", "pull", work)
        await ended
    finally:
        EventLog.append = original  # type: ignore[method-assign]
    delays = []
    for at, message in arrivals:
        try:
            delays.append(at - float(message))
        except ValueError:
            continue
    print(f"child's print to the job's events (in process, idle reactor; {job.state}):")
    print(f"  {figures(delays)}")
    return delays


# -- 2 and 3a: a real core -------------------------------------------------------------


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class Subscriber(threading.Thread):
    """
    Follows a job's events over a raw socket: each event with the wall time its frame
    was completely received, until the progress that ends the job.
    """

    def __init__(self, port: int, job: str) -> None:
        super().__init__(daemon=True)
        self.port, self.job = port, job
        self.received: list[tuple[float, dict[str, Any]]] = []
        self.following_at: float | None = None
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as error:
            self.error = error
        finally:
            self.done.set()

    def _follow(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(f"GET /installs/{self.job}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        buffer = b""
        headers_done = False
        try:
            while True:
                data = sock.recv(65536)
                now = time.time()
                if not data:
                    return
                buffer += data
                if not headers_done:
                    if b"\r\n\r\n" not in buffer:
                        continue
                    head, buffer = buffer.split(b"\r\n\r\n", 1)
                    if not head.startswith(b"HTTP/1.1 200"):
                        raise RuntimeError(head.decode(errors="replace"))
                    headers_done = True
                # Chunked transfer: the chunk framing lines are not SSE lines; drop
                # them by reading the frames out of the de-chunked text.
                buffer = self._dechunk(buffer)
                while b"\n\n" in self._text:
                    frame, self._text = self._text.split(b"\n\n", 1)
                    fields: dict[str, str] = {}
                    for line in frame.decode().split("\n"):
                        if line.startswith(": following"):
                            self.following_at = self.following_at or now
                        elif line and not line.startswith(":"):
                            name, _, value = line.partition(": ")
                            fields[name] = value
                    if "data" in fields and fields.get("event") != "resync":
                        event = json.loads(fields["data"])
                        self.received.append((now, event))
                        if event["kind"] == "progress" and event["progress"]["status"] != "running":
                            return
        finally:
            sock.close()

    _text = b""

    def _dechunk(self, buffer: bytes) -> bytes:
        while True:
            if b"\r\n" not in buffer:
                return buffer
            size_line, rest = buffer.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            if len(rest) < size + 2:
                return buffer
            self._text += rest[:size]
            buffer = rest[size + 2:]


def start_core(tmp: Path) -> tuple[subprocess.Popen[bytes], int, Any]:
    port = free_port()
    config = {
        "server": {"port": port, "host": "127.0.0.1", "shutdownGraceMs": 1000},
        "log": {"level": "error"},
        "workers": {"socketDir": str(tmp / "sock"), "voiceDir": str(tmp / "voices")},
        "engines": {"tone": {"module": "rhapsode_engine_tone", "python": str(ROOT / ".venvs/tone/bin/python")}},
        "install": {"venvDir": str(tmp / "venvs"), "sourceDir": str(ROOT / "engines")},
    }
    (tmp / "rhapsode.json").write_text(json.dumps(config))
    log = open(tmp / "core.log", "wb")
    rhapsode = str(Path(sys.executable).parent / "rhapsode")
    proc = subprocess.Popen([rhapsode, "serve", "--config", str(tmp / "rhapsode.json")], cwd=tmp, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_listening(port)
    except BaseException:
        stop(proc)
        raise
    return proc, port, log


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def speak_figures(tmp: Path) -> list[float]:
    """
    Figure 2 and the subscriber's half of figure 3; answers the subscriber's delays.
    """
    core, port, log = start_core(tmp)
    try:
        raw = request_bytes("/speak", {"engine": "tone", "text": SENTENCE, "format": "pcm"})
        kept = KeptAlive(tcp(port))
        for _ in range(50):
            kept.timed(raw)

        def sample(n: int) -> list[float]:
            return [kept.timed(raw)[0] for _ in range(n)]

        before = sample(IDLE_SAMPLES)
        code, job = call(port, "POST", f"/engines/{ENGINE}/install")
        if code != 202:
            print(f"speak: the install was refused: {code} {job}")
            return []
        subscriber = Subscriber(port, job["id"])
        subscriber.start()
        during: list[tuple[float, float]] = []
        while not subscriber.done.is_set():
            at = time.time()
            during.append((at, kept.timed(raw)[0]))
        subscriber.join(10)
        after = sample(IDLE_SAMPLES)
        kept.close()
        doc = call(port, "GET", f"/installs/{job['id']}")[1]
        began, ended = epoch(doc["startedAt"]), epoch(doc["finishedAt"])
        inside = [ttfb for at, ttfb in during if began <= at <= ended]
        idle = before + after
        print(f"/speak on tone while {ENGINE} installs in the core (job {doc['state']}, "
              f"{ended - began:.1f} s; the core uses uv if it finds one): time to first byte, one kept-alive connection")
        print(f"  idle before   {figures(before)}")
        print(f"  idle after    {figures(after)}")
        print(f"  idle (both)   {figures(idle)}")
        print(f"  installing    {figures(inside)}")
        if inside:
            print(f"  p99 installing / p99 idle = {percentile(inside, 0.99) / percentile(idle, 0.99):.2f}"
                  f"   (p50 ratio {percentile(inside, 0.5) / percentile(idle, 0.5):.2f}; "
                  f"{len(inside)} of {len(during)} samples inside the job's start and end)")
        if inside:
            # Where the worst samples fell: the step the job was in, from its events.
            marks = [(epoch(e["ts"]), e["progress"]["phase"]) for _, e in subscriber.received
                     if e["kind"] == "progress"]
            worst = sorted(((ttfb, at) for at, ttfb in during if began <= at <= ended), reverse=True)[:5]
            where = []
            for ttfb, at in worst:
                step = ([phase for mark, phase in marks if mark <= at] or ["?"])[-1]
                where.append(f"{ttfb * 1e3:.1f} ms at {at - began:.1f} s ({step})")
            print("  worst while installing: " + ", ".join(where))
        if subscriber.error is not None:
            print(f"  subscriber failed: {subscriber.error!r}")
        following = subscriber.following_at or 0.0
        logs = [(at, e) for at, e in subscriber.received if e["kind"] == "log"]
        live = [at - epoch(e["ts"]) for at, e in logs if epoch(e["ts"]) >= following]
        replayed = len(logs) - len(live)
        print(f"core's receipt of a line (its event's ts) to an SSE subscriber over loopback, log events "
              f"({replayed} replayed from before the subscription left out):")
        print(f"  {figures(live)}")
        over = sum(1 for d in live if d > 0.05)
        print(f"  over 50 ms: {over} of {len(live)}")
        return live
    finally:
        stop(core)
        log.close()


def main() -> None:
    rounds = 3
    only = {"install", "speak", "child"}
    args = sys.argv[1:]
    while args:
        flag = args.pop(0)
        if flag == "--rounds":
            rounds = int(args.pop(0))
        elif flag == "--only":
            only = set(args.pop(0).split(","))
        else:
            raise SystemExit(__doc__)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    tmp = Path(tempfile.mkdtemp(prefix="rhapsode-bench-install-"))
    try:
        subscriber: list[float] = []
        if "speak" in only:
            # Blocking sockets, before this process's reactor runs.
            (tmp / "core").mkdir()
            subscriber = speak_figures(tmp / "core")
        if only & {"install", "child"}:
            from twisted.internet import reactor

            child: list[float] = []

            async def in_process() -> None:
                if "install" in only:
                    await install_figures(reactor, tmp, rounds)
                if "child" in only:
                    child.extend(await child_figures(reactor))

            def run() -> None:
                d = Deferred.fromCoroutine(in_process())
                d.addErrback(lambda failure: failure.printTraceback())
                d.addBoth(lambda _: reactor.stop())

            reactor.callWhenRunning(run)
            reactor.run()
            if child and subscriber:
                print("an event, printed by the child to received by the subscriber (the sum of the two halves):")
                for p in (0.5, 0.99):
                    print(f"  p{int(p * 100)} {(percentile(child, p) + percentile(subscriber, p)) * 1e3:7.2f} ms")
                print(f"  max {(max(child) + max(subscriber)) * 1e3:7.2f} ms")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
