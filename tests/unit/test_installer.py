"""
The installer (protocol.md section 10, "Installing" to "Pulling weights") with nothing
spawned: a fake runner that records each command and makes the virtualenv a venv
command would, a fake host whose quiet is a real L{Residency}'s, a real state database
whose writes run inline, and a catalog built from records written here.  Time is a
L{Clock}; every job runs to its end inside the call that starts it unless the runner
holds a command for the test to release.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from _deferreds import failure_of, result_of
from test_install_residency import Settings
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from rhapsode._fleet.catalog import Catalog
from rhapsode._fleet.residency import Lease, Residency
from rhapsode._manage.installer import PACKAGES_SECONDS, QUICK_SECONDS, SILENCE_SECONDS, Installer
from rhapsode._manage.jobs import Job, JobContext, JobFailed, Jobs
from rhapsode._manage.state import InstalledEngine, StateDatabase, StateStore
from rhapsode_protocol.errors import BadRequest, Conflict, Internal, UnknownEngine, Unsupported

_T = TypeVar("_T")
CORE = "0.1.0"
NC = "CC-BY-NC-4.0"

KOKORO = {
    "id": "kokoro", "displayName": "Kokoro-82M", "module": "rhapsode_engine_kokoro",
    "distribution": "rhapsode-engine-kokoro", "python": ">=3.8",
    "license": {"code": "GPL-3.0-or-later", "weights": "Apache-2.0", "weightsCommercialUse": True},
}
RESEARCH = {
    "id": "research", "module": "rhapsode_engine_research", "distribution": "rhapsode-engine-research",
    "license": {"code": "MIT", "weights": NC, "weightsCommercialUse": False},
}
TONE = {
    "id": "tone", "module": "rhapsode_engine_tone", "distribution": "rhapsode-engine-tone",
    "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True},
}
#: A torch engine's record: on a CPU box torch's CPU build first, then the rest.
TORCHY = {
    "id": "torchy", "module": "rhapsode_engine_torchy", "distribution": "rhapsode-engine-torchy",
    "license": {"code": "MIT", "weights": "MIT", "weightsCommercialUse": True},
    "install": {"cuda": [["{sdk}", "{adapter}"]], "cpu": [["torch==2.13.0"], ["{sdk}", "{adapter}"]]},
}




class InlinePool:
    """
    A thread pool that runs each call at once on the caller's thread.
    """

    started = True

    def callInThreadWithCallback(self, on_result: Callable[[bool, Any], None], f: Callable[..., Any],
                                 *args: Any, **kwargs: Any) -> None:
        try:
            result = f(*args, **kwargs)
        except BaseException:
            on_result(False, Failure())
        else:
            on_result(True, result)

    def stop(self) -> None:
        pass


class InlineReactor(Clock):
    """
    A Clock that is also the reactor thread: what the pool hands back runs at once.
    """

    def callFromThread(self, f: Callable[..., Any], *args: Any) -> None:
        f(*args)

    def getThreadPool(self) -> InlinePool:
        return InlinePool()


class InlineDatabase(StateDatabase):
    """
    The real state database over a real file, its writes run inline rather than on its
    thread, so a test sees each committed as it is asked for.
    """

    def _started(self) -> Any:
        return InlinePool()


def make_venv(slot: Path, version: str) -> None:
    """
    What a venv command leaves, as far as the core reads it: bin/python, pyvenv.cfg, and
    the SDK's metadata at C{version} (its workerVersion, section 9).
    """
    (slot / "bin").mkdir(parents=True, exist_ok=True)
    (slot / "bin" / "python").write_text("")
    (slot / "pyvenv.cfg").write_text("home = /usr/bin\n")
    info = slot / "lib" / "python3.11" / "site-packages" / f"rhapsode_worker-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rhapsode-worker\nVersion: {version}\n")


class FakeRunner:
    """
    Records each command with its limits, logs it as the real runner does, makes the
    slot a venv command names, and fails or holds the commands the test picks.
    """

    def __init__(self) -> None:
        self.argvs: list[tuple[str, ...]] = []
        self.limits: list[tuple[float, float | None]] = []
        self.version = CORE
        self.fail: Callable[[tuple[str, ...]], str | None] = lambda argv: None
        self.hold: Callable[[tuple[str, ...]], bool] = lambda argv: False
        self.held: list[Deferred[None]] = []

    async def run(self, context: JobContext, argv: Sequence[str], *, timeout: float = QUICK_SECONDS,
                  silence: float | None = None, env: Mapping[str, str] | None = None,
                  on_line: Callable[[str], None] | None = None) -> None:
        command = tuple(argv)
        self.argvs.append(command)
        self.limits.append((timeout, silence))
        context.log("$ " + " ".join(command))
        if self.hold(command):
            held: Deferred[None] = Deferred()
            self.held.append(held)
            await held
        if "venv" in command[:3]:
            make_venv(Path(command[-1]), self.version)
        why = self.fail(command)
        if why is not None:
            raise JobFailed(Internal(why))
        if on_line is not None:
            on_line("3.11.7")


@dataclass
class FakeHost:
    """
    The running core as the installer sees it: which engines are registered, which the
    operator's file names, and what was declared, replaced, retired and fetched.  Its
    quiet is a real residency manager's, so a lease held on an engine is speaking.
    """

    catalog: Catalog
    residency: Residency
    registered_ids: set[str] = field(default_factory=set)
    operator: set[str] = field(default_factory=set)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    fetch_fails: BaseException | None = None
    required: list[bool] = field(default_factory=list)
    clusters: dict[str, str] = field(default_factory=dict)

    def registered(self, engine_id: str) -> bool:
        return engine_id in self.registered_ids

    def operator_engines(self) -> set[str]:
        return set(self.operator)

    def cluster_of(self, engine_id: str) -> str | None:
        return self.clusters.get(engine_id)

    def declare(self, engine_id: str, entry: Mapping[str, Any]) -> None:
        self.calls.append(("declare", engine_id))
        self.registered_ids.add(engine_id)
        self.catalog.declare(engine_id, entry["module"], entry["python"])

    def retire(self, engine_id: str) -> Deferred[None]:
        self.calls.append(("retire", engine_id))
        self.registered_ids.discard(engine_id)
        self.catalog.forget(engine_id)
        return succeed(None)

    def replace(self, engine_id: str, entry: Mapping[str, Any]) -> Deferred[None]:
        self.calls.append(("replace", entry["python"]))
        self.catalog.declare(engine_id, entry["module"], entry["python"])
        return succeed(None)

    async def quiet(self, engine_id: str, work: Callable[[], Awaitable[_T]], wait: float | None) -> _T:
        async def run() -> _T:
            return await work()

        return await self.residency.quiet(engine_id, run, wait)

    async def fetch(self, engine_id: str, variant: str, context: JobContext, required: bool = True) -> None:
        self.calls.append(("fetch", (engine_id, variant)))
        self.required.append(required)
        if self.fetch_fails is not None:
            raise self.fetch_fails


class Harness:
    """
    An installer over the fakes, its venvs under a temporary directory.
    """

    def __init__(self, tmp_path: Path, records: Sequence[Mapping[str, Any]] = (KOKORO, RESEARCH, TONE),
                 database: bool = True, uv: str | None = None, box: str = "cpu") -> None:
        self.tmp = tmp_path
        self.reactor = InlineReactor()
        self.jobs = Jobs(self.reactor)
        self.catalog = Catalog(records, CORE)
        self.db_path = tmp_path / "rhapsode.db"
        self.state = InlineDatabase(StateStore.open(self.db_path), self.reactor) if database else None
        self.terminated: list[str] = []
        self.residency = Residency(clock=self.reactor, settings=Settings(),
                                   terminate=self._terminate, unload=self._terminate)
        self.host = FakeHost(self.catalog, self.residency)
        self.runner = FakeRunner()
        self.venvs = tmp_path / "venvs"
        self.source: Path | None = None
        self.installer = Installer(
            reactor=self.reactor, jobs=self.jobs, catalog=self.catalog, state=self.state, host=self.host,
            venv_dir=lambda: self.venvs, source_dir=lambda: self.source, interpreter=lambda: None,
            runner=self.runner, environ={"RHAPSODE_PIP_TRUSTED_HOSTS": "mirror.local"}, core_version=CORE,
            uv=uv, sdk=("/src/rhapsode/protocol", "/src/rhapsode/sdk"), box=lambda: box,
        )

    def _terminate(self, engine: str) -> Deferred[None]:
        self.terminated.append(engine)
        return succeed(None)

    def close(self) -> None:
        Deferred.fromCoroutine(self.jobs.close())
        if self.state is not None:
            self.state.close()
            self.state.store.close()

    def on_disk(self) -> dict[str, InstalledEngine]:
        """
        What the database file holds, read afresh.
        """
        store = StateStore.open(self.db_path)
        try:
            return store.engines()
        finally:
            store.close()

    def seed(self, record: Mapping[str, Any], version: str, accepted: str | None = None,
             slot_name: str | None = None) -> Path:
        """
        An engine installed by an earlier core: its venv at C{version}, its entry in the
        database, registered and declared.
        """
        engine_id = str(record["id"])
        slot = self.venvs / (slot_name or engine_id)
        make_venv(slot, version)
        entry = {"module": record["module"], "python": str(slot / "bin" / "python")}
        assert self.state is not None
        result_of(self.state.put_engine(InstalledEngine(engine_id, entry, accepted)))
        self.host.registered_ids.add(engine_id)
        self.catalog.declare(engine_id, str(record["module"]), entry["python"])
        self.catalog.managed.add(engine_id)
        return slot

    def lease(self, engine: str) -> Lease:
        lease: Lease = result_of(Deferred.fromCoroutine(self.residency.acquire(engine, "base")))
        return lease


@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def kinds(job: Job) -> list[tuple[str, str]]:
    out = []
    for _, frame in job.events.after(0)[1]:
        lines = frame.decode().split("\n")
        event = json.loads(lines[2][len("data: "):])
        out.append((event["kind"], event["message"]))
    return out


def progress(job: Job) -> list[tuple[str, str]]:
    out = []
    for _, frame in job.events.after(0)[1]:
        event = json.loads(frame.decode().split("\n")[2][len("data: "):])
        if event["kind"] == "progress":
            out.append((event["progress"]["phase"], event["progress"]["status"]))
    return out


# -- refusals, before any job -----------------------------------------------------------


def test_an_engine_not_in_the_catalog_is_unknown_engine_listing_the_catalog(h: Harness) -> None:
    """
    unknown_engine, naming every id the catalog has; no job is made.
    """
    with pytest.raises(UnknownEngine) as caught:
        h.installer.install("chatterbox", None, None)
    assert "kokoro, research, tone" in caught.value.message
    assert h.jobs.all() == []


@pytest.mark.parametrize("bad", ["..", "a/b", "tone\u0435", "x" * 65])
def test_a_bad_engine_id_is_bad_request_for_every_route(h: Harness, bad: str) -> None:
    """
    install, reinstall, uninstall and pull refuse an id that is not one before looking
    anything up.
    """
    with pytest.raises(BadRequest):
        h.installer.install(bad, None, None)
    with pytest.raises(BadRequest):
        h.installer.reinstall(bad, None)
    assert failure_of(Deferred.fromCoroutine(h.installer.uninstall(bad))).check(BadRequest)
    with pytest.raises(BadRequest):
        h.installer.pull(bad, {"variant": "base"})
    assert h.jobs.all() == []


def test_an_engine_the_operator_configured_is_conflict_even_disabled(h: Harness) -> None:
    """
    An engine the operator's file names (null, disabled, included) would win over what
    the install recorded: conflict, and nothing runs.
    """
    from rhapsode._service import _operator_engines

    h.host.operator = _operator_engines({"engines": {"kokoro": None}})
    with pytest.raises(Conflict) as caught:
        h.installer.install("kokoro", None, None)
    assert caught.value.field == "engine"
    assert h.runner.argvs == [] and h.jobs.all() == []


def test_an_installed_engine_is_conflict(h: Harness) -> None:
    """
    An engine that is registered already: conflict, pointing at reinstall.
    """
    h.seed(KOKORO, CORE)
    with pytest.raises(Conflict) as caught:
        h.installer.install("kokoro", None, None)
    assert "reinstall" in caught.value.message


def test_an_engine_with_a_job_is_conflict(h: Harness) -> None:
    """
    An install queued or running for the engine: a second is conflict naming the job.
    """
    h.runner.hold = lambda argv: True
    job = h.installer.install("kokoro", None, None)
    assert job.state == "running"
    with pytest.raises(Conflict) as caught:
        h.installer.install("kokoro", None, None)
    assert job.id in caught.value.message
    assert len(h.jobs.all()) == 1


def test_without_a_state_database_an_install_is_unsupported(tmp_path: Path) -> None:
    """
    A core embedded without a state database has nowhere to record an install.
    """
    harness = Harness(tmp_path, database=False)
    try:
        with pytest.raises(Unsupported):
            harness.installer.install("kokoro", None, None)
        with pytest.raises(Unsupported):
            harness.installer.outdated()
        assert harness.jobs.all() == []
    finally:
        harness.close()


def test_without_a_state_database_every_engine_is_the_operators(tmp_path: Path) -> None:
    """
    A server without a state database installed nothing: a reinstall or an uninstall of
    an engine it has is conflict (the operator's), of one it lacks unknown_engine.
    """
    harness = Harness(tmp_path, database=False)
    try:
        harness.host.registered_ids.add("tone")
        with pytest.raises(Conflict):
            harness.installer.reinstall("tone", None)
        assert isinstance(failure_of(Deferred.fromCoroutine(harness.installer.uninstall("tone"))).value, Conflict)
        with pytest.raises(UnknownEngine):
            harness.installer.reinstall("kokoro", None)
        assert isinstance(failure_of(Deferred.fromCoroutine(harness.installer.uninstall("kokoro"))).value,
                          UnknownEngine)
        assert harness.jobs.all() == []
    finally:
        harness.close()


def test_a_non_commercial_licence_needs_accept_naming_it(h: Harness) -> None:
    """
    weightsCommercialUse false: without accept, bad_request naming the licence and the
    query that accepts it; with it, a job.
    """
    with pytest.raises(BadRequest) as caught:
        h.installer.install("research", None, None)
    assert caught.value.field == "accept"
    assert NC in caught.value.message and f"accept={NC}" in caught.value.message
    assert h.jobs.all() == []
    job = h.installer.install("research", None, NC)
    assert job.state == "succeeded"
    assert h.on_disk()["research"].accepted == NC


@pytest.mark.parametrize("engine, accept", [
    ("research", "cc-by-nc-4.0"), ("research", "CC-BY-NC-4.0 "), ("research", "MIT"),
    ("kokoro", "CC-BY-NC-4.0"), ("kokoro", "apache-2.0"),
])
def test_an_accept_naming_another_licence_is_refused_even_for_a_commercial_engine(
        h: Harness, engine: str, accept: str) -> None:
    """
    accept must name the catalog's weights licence exactly, whichever kind the engine
    is, so a client may send it on every install.
    """
    with pytest.raises(BadRequest) as caught:
        h.installer.install(engine, None, accept)
    assert caught.value.field == "accept"
    assert h.jobs.all() == []


def test_an_accept_naming_a_commercial_licence_is_taken_and_recorded(h: Harness) -> None:
    """
    accept=Apache-2.0 on kokoro names its licence: installed, and recorded.
    """
    job = h.installer.install("kokoro", None, "Apache-2.0")
    assert job.state == "succeeded"
    assert h.on_disk()["kokoro"].accepted == "Apache-2.0"


def test_a_bad_pull_variant_is_bad_request(h: Harness) -> None:
    """
    ?pull= must name a variant: nothing with a slash, and no trailing newline.
    """
    for bad in ("../x", "turbo\n"):
        with pytest.raises(BadRequest) as caught:
            h.installer.install("kokoro", bad, None)
        assert caught.value.field == "pull"


# -- install ----------------------------------------------------------------------------


def test_an_install_runs_its_steps_in_order_and_registers_the_engine(h: Harness) -> None:
    """
    venv, packages (pip upgraded, then one resolve with the trusted host), verify, then
    register: recorded in the database with what was accepted, declared to the core,
    managed; the job's events in the order section 10 gives.
    """
    job = h.installer.install("kokoro", None, None)
    assert job.state == "succeeded", job.error
    slot = h.venvs / "kokoro"
    python = str(slot / "bin" / "python")
    assert h.runner.argvs == [
        (str(Path(sys.executable).resolve()), "-m", "venv", str(slot)),
        (python, "-m", "pip", "install", "--upgrade", "pip"),
        (python, "-m", "pip", "install", "--progress-bar", "raw", "--no-input", "--trusted-host", "mirror.local",
         "/src/rhapsode/protocol", "/src/rhapsode/sdk", "rhapsode-engine-kokoro==0.1.0"),
        (python, "-c", "import rhapsode_engine_kokoro"),
    ]
    assert h.runner.limits[2] == (PACKAGES_SECONDS, SILENCE_SECONDS)
    assert h.runner.limits[3][0] == QUICK_SECONDS
    assert progress(job) == [("venv", "running"), ("packages", "running"), ("verify", "running"),
                             ("register", "running"), ("register", "done")]
    events = kinds(job)
    assert events[0] == ("status", "install kokoro queued")
    assert events[-2] == ("status", "install kokoro succeeded")
    assert ("log", "$ " + " ".join(h.runner.argvs[1])) in events
    entry = {"module": "rhapsode_engine_kokoro", "python": python}
    assert h.on_disk() == {"kokoro": InstalledEngine("kokoro", entry, None)}
    assert h.host.calls == [("declare", "kokoro")]
    assert "kokoro" in h.catalog.managed
    [catalog_entry] = [e for e in h.catalog.entries() if e["id"] == "kokoro"]
    assert catalog_entry["installed"] == "yes" and catalog_entry["managed"] is True
    assert catalog_entry["outdated"] is False


def test_an_engine_is_no_longer_installing_once_its_install_has_ended(h: Harness) -> None:
    """
    The catalog says installing only while the job is queued or running: not after it
    succeeded, and not after it failed, even when it failed before running anything.
    """
    h.runner.hold = lambda argv: "venv" in argv[:3]
    job = h.installer.install("kokoro", None, None)
    assert "kokoro" in h.catalog.installing
    assert [e["installed"] for e in h.catalog.entries() if e["id"] == "kokoro"] == ["installing"]
    h.runner.held.pop().callback(None)
    assert job.state == "succeeded"
    assert "kokoro" not in h.catalog.installing
    h.runner.hold = lambda argv: False

    quick = h.installer.install("tone", None, None)
    assert quick.state == "succeeded"
    assert "tone" not in h.catalog.installing

    (h.tmp / "not-a-dir").write_text("")
    h.venvs = h.tmp / "not-a-dir" / "venvs"
    failed = h.installer.install("research", None, NC)
    assert failed.state == "failed"
    assert "research" not in h.catalog.installing
    [entry] = [e for e in h.catalog.entries() if e["id"] == "research"]
    assert entry["installed"] == "no"


def test_an_install_with_pull_fetches_the_variant_after_registering(h: Harness) -> None:
    """
    ?pull=turbo adds step 5: the engine is registered first, then its worker fetches.
    """
    job = h.installer.install("kokoro", "v1.0-int8", None)
    assert job.state == "succeeded"
    assert job.document()["variant"] == "v1.0-int8"
    assert progress(job)[-2:] == [("weights", "running"), ("weights", "done")]
    assert h.host.calls == [("declare", "kokoro"), ("fetch", ("kokoro", "v1.0-int8"))]
    # An engine without fetch has nothing to do in step 5, and the install succeeds.
    assert h.host.required == [False]


def test_a_failed_fetch_leaves_the_engine_installed(h: Harness) -> None:
    """
    The engine is registered before weights: a failed download fails the job at
    weights and the engine stays installed (the way on is a pull).
    """
    h.host.fetch_fails = Internal("download failed: connection reset")
    job = h.installer.install("kokoro", "v1.0-int8", None)
    assert job.state == "failed" and job.error is not None
    assert job.error["message"] == "download failed: connection reset"
    assert progress(job)[-1] == ("weights", "failed")
    assert "kokoro" in h.on_disk() and h.host.registered("kokoro")


def test_a_failing_packages_step_fails_the_job_with_its_reason_and_leaves_nothing(h: Harness) -> None:
    """
    pip fails: the job fails at packages with the command's message, nothing is
    registered or recorded, and the half-built slot is removed.
    """
    h.runner.fail = lambda argv: (
        "pip install exited 1: error: command 'gcc' failed (building llama-cpp-python)"
        if "--progress-bar" in argv else None
    )
    job = h.installer.install("kokoro", None, None)
    assert job.state == "failed" and job.error is not None
    assert job.error["message"] == "pip install exited 1: error: command 'gcc' failed (building llama-cpp-python)"
    assert progress(job)[-1] == ("packages", "failed")
    assert kinds(job)[-1][0] == "progress" and kinds(job)[-2][0] == "error"
    assert h.on_disk() == {} and h.host.calls == []
    assert not (h.venvs / "kokoro").exists()
    assert "kokoro" not in h.catalog.managed


def test_the_remains_of_an_earlier_install_are_removed_first(h: Harness) -> None:
    """
    A slot that no registered engine runs from, and the .alt slot, are what an install
    that did not finish left: both removed before the venv is made.
    """
    for name in ("kokoro", "kokoro.alt"):
        (h.venvs / name / "lib").mkdir(parents=True)
        (h.venvs / name / "lib" / "half-written.py").write_text("")
    job = h.installer.install("kokoro", None, None)
    assert job.state == "succeeded"
    assert not (h.venvs / "kokoro" / "lib" / "half-written.py").exists()
    assert not (h.venvs / "kokoro.alt").exists()
    messages = [message for kind, message in kinds(job) if kind == "log"]
    assert any(message.startswith(f"removing {h.venvs / 'kokoro.alt'}: ") for message in messages)
    assert any(message.startswith(f"removing {h.venvs / 'kokoro'}: ") for message in messages)


def test_an_interpreter_outside_the_range_fails_without_uv(h: Harness) -> None:
    """
    Without uv, pip given an interpreter outside the record's range quietly installs an
    older release: the job fails at venv naming both, and runs no venv command.
    """
    h.catalog.records[0]["python"] = "<3.0"
    job = h.installer.install("kokoro", None, None)
    assert job.state == "failed" and job.error is not None
    assert "<3.0" in job.error["message"]
    assert not any("venv" in argv[:3] for argv in h.runner.argvs)


def test_with_uv_an_interpreter_outside_the_range_hands_uv_the_range(tmp_path: Path) -> None:
    """
    With uv, the range goes to uv venv --python and no pip upgrade runs.
    """
    harness = Harness(tmp_path, uv="/usr/bin/uv")
    try:
        harness.catalog.records[0]["python"] = "<3.0"
        job = harness.installer.install("kokoro", None, None)
        assert job.state == "succeeded", job.error
        assert harness.runner.argvs[0] == ("/usr/bin/uv", "venv", "--seed", "--python", "<3.0",
                                           str(harness.venvs / "kokoro"))
        assert not any("--upgrade" in argv for argv in harness.runner.argvs)
    finally:
        harness.close()


def test_the_adapter_comes_from_the_source_dir_by_a_copy_inside_the_slot(h: Harness) -> None:
    """
    install.sourceDir/<id> exists: pip installs a copy of the folder made inside the
    slot (pip builds a folder in place, and the checkout may be read-only), which the
    finished install removes; the checkout's folder is left as it was.
    """
    h.source = h.tmp / "engines"
    adapter = h.source / "kokoro"
    (adapter / "build").mkdir(parents=True)
    (adapter / "setup.cfg").write_text("[metadata]\nname = rhapsode-engine-kokoro\n")
    copied: list[list[str]] = []

    def look(argv: tuple[str, ...]) -> None:
        # What pip would build from, as it runs.
        if "pip" in argv and Path(argv[-1]).is_dir():
            copied.append(sorted(p.name for p in Path(argv[-1]).iterdir()))

    h.runner.fail = look  # type: ignore[assignment]
    job = h.installer.install("kokoro", None, None)
    assert job.state == "succeeded", job.error
    staged = h.venvs / "kokoro" / ".sources"
    assert h.runner.argvs[2][-1] == str(staged / "0-kokoro")
    assert copied == [["setup.cfg"]]
    assert not staged.exists()
    assert sorted(p.name for p in adapter.iterdir()) == ["build", "setup.cfg"]


# -- reinstall --------------------------------------------------------------------------


def test_a_reinstall_builds_in_the_other_slot_and_deletes_the_old_one_last(h: Harness) -> None:
    """
    Running from <id>: built, verified and registered from <id>.alt, the database
    committed before the swap, the old slot deleted; the next reinstall goes back.
    """
    old = h.seed(KOKORO, "0.0.9")
    assert h.catalog.versions("kokoro")["outdated"] is True
    job = h.installer.reinstall("kokoro", None)
    assert job.kind == "reinstall" and job.state == "succeeded", job.error
    alt = h.venvs / "kokoro.alt"
    assert h.runner.argvs[0][-1] == str(alt)
    assert h.on_disk()["kokoro"].entry["python"] == str(alt / "bin" / "python")
    assert h.host.calls == [("replace", str(alt / "bin" / "python"))]
    assert not old.exists() and alt.exists()
    assert h.catalog.versions("kokoro") == {"workerVersion": CORE, "outdated": False}
    assert progress(job) == [("venv", "running"), ("packages", "running"), ("verify", "running"),
                             ("register", "running"), ("register", "done")]

    again = h.installer.reinstall("kokoro", None)
    assert again.state == "succeeded"
    assert h.on_disk()["kokoro"].entry["python"] == str(old / "bin" / "python")
    assert old.exists() and not alt.exists()


def test_a_reinstall_that_fails_before_register_changes_nothing(h: Harness) -> None:
    """
    verify fails: the engine, its database entry, its venv and its version are as they
    were; only the other slot's remains are removed.
    """
    old = h.seed(KOKORO, "0.0.9")
    before = h.on_disk()
    h.runner.fail = lambda argv: "python -c (verify) exited 1: ImportError" if "-c" in argv else None
    job = h.installer.reinstall("kokoro", None)
    assert job.state == "failed"
    assert progress(job)[-1] == ("verify", "failed")
    assert h.on_disk() == before
    assert h.host.calls == []
    assert old.exists() and (old / "bin" / "python").exists()
    assert not (h.venvs / "kokoro.alt").exists()
    assert h.catalog.versions("kokoro")["workerVersion"] == "0.0.9"


def test_a_reinstall_waits_for_the_engine_to_stop_speaking(h: Harness) -> None:
    """
    register takes the lock a load takes and waits while the engine holds a lease; it
    swaps once the lease ends, and the model it held is forgotten.
    """
    h.seed(KOKORO, "0.0.9")
    lease = h.lease("kokoro")
    job = h.installer.reinstall("kokoro", None)
    assert job.state == "running" and job.step == "register"
    assert h.host.calls == []
    h.reactor.advance(60)
    assert job.state == "running"
    lease.release()
    assert job.state == "succeeded"
    assert h.residency.snapshot()["models"] == []


def test_a_reinstall_still_speaking_after_ten_minutes_fails_with_conflict(h: Harness) -> None:
    """
    Past the wait, the job fails with conflict and nothing has changed.
    """
    old = h.seed(KOKORO, "0.0.9")
    h.lease("kokoro")
    job = h.installer.reinstall("kokoro", None)
    h.reactor.advance(600)
    assert job.state == "failed" and job.error is not None and job.error["code"] == "conflict"
    assert h.on_disk()["kokoro"].entry["python"] == str(old / "bin" / "python")
    assert h.host.calls == []


def test_reinstall_refusals(h: Harness) -> None:
    """
    Not installed, or not in the catalog: unknown_engine.  The operator's: conflict.
    A job for it already: conflict.  All before a job exists.
    """
    with pytest.raises(UnknownEngine):
        h.installer.reinstall("kokoro", None)
    with pytest.raises(UnknownEngine):
        h.installer.reinstall("nothere", None)
    h.seed(TONE, CORE)
    h.host.operator = {"tone"}
    with pytest.raises(Conflict):
        h.installer.reinstall("tone", None)
    h.host.operator = set()
    h.seed(KOKORO, CORE)
    h.runner.hold = lambda argv: True
    h.installer.reinstall("kokoro", None)
    with pytest.raises(Conflict):
        h.installer.reinstall("kokoro", None)
    assert len(h.jobs.all()) == 1


def test_a_reinstall_needs_no_accept_when_the_recorded_one_covers_it(h: Harness) -> None:
    """
    The entry's accepted is the catalog's weights licence: no accept needed, and it
    stays recorded.
    """
    h.seed(RESEARCH, "0.0.9", accepted=NC)
    job = h.installer.reinstall("research", None)
    assert job.state == "succeeded"
    assert h.on_disk()["research"].accepted == NC


@pytest.mark.parametrize("recorded", [None, "CC-BY-NC-3.0"])
def test_a_reinstall_needs_accept_when_none_or_another_licence_was_recorded(
        h: Harness, recorded: str | None) -> None:
    """
    No accepted recorded (an older core), or another licence (the catalog relicensed):
    refused without accept, taken with it, and the new acceptance recorded.
    """
    h.seed(RESEARCH, "0.0.9", accepted=recorded)
    with pytest.raises(BadRequest) as caught:
        h.installer.reinstall("research", None)
    assert caught.value.field == "accept"
    with pytest.raises(BadRequest):
        h.installer.reinstall("research", "CC-BY-NC-3.0")
    job = h.installer.reinstall("research", NC)
    assert job.state == "succeeded"
    assert h.on_disk()["research"].accepted == NC


# -- outdated ---------------------------------------------------------------------------


def test_outdated_queues_a_reinstall_per_engine_behind_in_id_order_and_skips_with_reasons(h: Harness) -> None:
    """
    Every engine this API installed whose outdated is true, in id order; licence where a
    reinstall would need accept, busy where a job is queued or running, uncatalogued
    where the catalog no longer has it.  Current ones and the operator's are left out.
    """
    h.runner.hold = lambda argv: True
    gone = {"id": "gone", "module": "rhapsode_engine_gone", "license": TONE["license"]}
    h.catalog.records.append(gone)
    h.seed(gone, "0.0.1")
    h.catalog.records.remove(gone)
    h.seed(TONE, "0.0.9")
    h.seed(KOKORO, "0.0.9")
    h.seed(RESEARCH, "0.0.9", accepted=None)
    current = {"id": "current", "module": "rhapsode_engine_current", "license": TONE["license"]}
    h.catalog.records.append(current)
    h.seed(current, CORE)
    mine = {"id": "mine", "module": "rhapsode_engine_mine", "license": TONE["license"]}
    h.catalog.records.append(mine)
    h.seed(mine, "0.0.9")
    h.host.operator = {"mine"}
    # A pull for tone waits behind a held install: tone is busy.
    blocker = {"id": "blocker", "module": "rhapsode_engine_blocker", "license": TONE["license"]}
    h.catalog.records.append(blocker)
    h.installer.install("blocker", None, None)
    h.installer.pull("tone", {"variant": "base"})
    answer = h.installer.outdated()
    assert [job["engine"] for job in answer["jobs"]] == ["kokoro"]
    assert answer["jobs"][0]["kind"] == "reinstall" and answer["jobs"][0]["state"] == "queued"
    assert answer["skipped"] == [
        {"engine": "gone", "reason": "uncatalogued"},
        {"engine": "research", "reason": "licence"},
        {"engine": "tone", "reason": "busy"},
    ]


def test_outdated_with_nothing_behind_is_no_jobs(h: Harness) -> None:
    """
    Nothing behind: jobs [], a success to run every night.
    """
    h.seed(KOKORO, CORE)
    assert h.installer.outdated() == {"jobs": [], "skipped": []}


def test_outdated_queues_several_in_id_order(h: Harness) -> None:
    """
    Two engines behind: two reinstalls, alphabetical.
    """
    h.seed(TONE, "0.0.9")
    h.seed(KOKORO, "0.0.8")
    h.runner.hold = lambda argv: True
    answer = h.installer.outdated()
    assert [job["engine"] for job in answer["jobs"]] == ["kokoro", "tone"]


# -- uninstall --------------------------------------------------------------------------


def test_uninstall_removes_the_entry_the_worker_and_both_slots(h: Harness) -> None:
    """
    The database entry and its per-engine settings go, the host retires the engine, and
    both slots are deleted; the catalog no longer calls it managed.
    """
    slot = h.seed(KOKORO, CORE)
    (h.venvs / "kokoro.alt").mkdir()
    assert h.state is not None
    result_of(h.state.write_settings({"engines.kokoro.keepAliveSeconds": 5, "server.port": 8080}))
    result_of(Deferred.fromCoroutine(h.installer.uninstall("kokoro")))
    assert h.on_disk() == {}
    assert h.state.settings() == {"server.port": 8080}
    assert h.host.calls == [("retire", "kokoro")]
    assert not slot.exists() and not (h.venvs / "kokoro.alt").exists()
    assert "kokoro" not in h.catalog.managed


def test_uninstall_refusals(h: Harness) -> None:
    """
    The operator's: conflict.  Not installed: unknown_engine.  Speaking: conflict, and
    nothing is removed.
    """
    def uninstall(engine: str) -> Failure:
        return failure_of(Deferred.fromCoroutine(h.installer.uninstall(engine)))

    h.host.operator = {"tone"}
    h.host.registered_ids.add("tone")
    assert uninstall("tone").check(Conflict)
    assert uninstall("kokoro").check(UnknownEngine)
    slot = h.seed(KOKORO, CORE)
    lease = h.lease("kokoro")
    assert uninstall("kokoro").check(Conflict)
    assert "kokoro" in h.on_disk() and slot.exists() and h.host.calls == []
    lease.release()
    result_of(Deferred.fromCoroutine(h.installer.uninstall("kokoro")))
    assert not slot.exists()


def test_uninstall_while_a_job_runs_for_the_engine_is_conflict(h: Harness) -> None:
    """
    A pull running for the engine: its uninstall is conflict.
    """
    h.seed(KOKORO, CORE)
    gate: Deferred[None] = Deferred()

    async def held_fetch(engine_id: str, variant: str, context: JobContext, required: bool = True) -> None:
        await gate

    h.host.fetch = held_fetch  # type: ignore[method-assign]
    h.installer.pull("kokoro", {"variant": "base"})
    assert failure_of(Deferred.fromCoroutine(h.installer.uninstall("kokoro"))).check(Conflict)
    gate.callback(None)


# -- pull -------------------------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    (None, "body"), ([], "body"), ({"variant": "base", "extra": 1}, "body"),
    ({}, "variant"), ({"variant": 3}, "variant"), ({"variant": ""}, "variant"), ({"variant": "../x"}, "variant"),
])
def test_a_pull_body_that_is_not_a_variant_is_bad_request(h: Harness, body: Any, field: str) -> None:
    """
    A pull takes {"variant": "..."} and nothing else.
    """
    h.seed(KOKORO, CORE)
    with pytest.raises(BadRequest) as caught:
        h.installer.pull("kokoro", body)
    assert caught.value.field == field
    assert h.jobs.all() == []


def test_a_pull_for_an_engine_not_installed_is_unknown_engine(h: Harness) -> None:
    """
    An engine that is not registered has no worker to fetch with.
    """
    with pytest.raises(UnknownEngine):
        h.installer.pull("kokoro", {"variant": "base"})


def test_a_pull_fetches_the_variant_in_a_job_of_one_step(h: Harness) -> None:
    """
    A pull's job has the weights step only and calls the worker's fetch with the
    variant; it asks no licence, and an operator's engine may be pulled.
    """
    h.host.registered_ids.add("research")
    h.host.operator = {"research"}
    job = h.installer.pull("research", {"variant": "turbo"})
    assert job.kind == "pull" and job.state == "succeeded" and job.variant == "turbo"
    assert progress(job) == [("weights", "running"), ("weights", "done")]
    assert h.host.calls == [("fetch", ("research", "turbo"))]
    # A pull of an engine without fetch is unsupported.
    assert h.host.required == [True]


def test_an_engine_that_runs_on_a_cluster_is_installed_on_its_nodes_not_its_front(tmp_path: Path) -> None:
    """
    Installing, at a cluster's front, an engine the cluster's nodes serve is refused as
    a conflict that says where to install it instead: on every node.
    """
    h = Harness(tmp_path)
    h.host.clusters["kokoro"] = "http://head:8000/rhapsode"
    with pytest.raises(Conflict, match="install it on every node") as refused:
        h.installer.install("kokoro", None, None)
    assert refused.value.field == "engine" and h.runner.argvs == []


def test_a_torch_engine_installs_by_its_recipe_for_this_box(tmp_path: Path) -> None:
    """
    On a CPU box the record's cpu recipe runs (torch's CPU build, then the SDK and the
    adapter); on a CUDA box its cuda one; the trusted host goes with every step.
    """
    for box, installs in (
        ("cpu", [("torch==2.13.0",), ("/src/rhapsode/protocol", "/src/rhapsode/sdk", "rhapsode-engine-torchy==0.1.0")]),
        ("cuda", [("/src/rhapsode/protocol", "/src/rhapsode/sdk", "rhapsode-engine-torchy==0.1.0")]),
    ):
        (tmp_path / box).mkdir()
        h = Harness(tmp_path / box, records=(TORCHY,), box=box)
        try:
            job = h.installer.install("torchy", None, None)
            assert job.state == "succeeded", job.error
            python = str(h.venvs / "torchy" / "bin" / "python")
            pip = (python, "-m", "pip", "install", "--progress-bar", "raw", "--no-input", "--trusted-host", "mirror.local")
            assert h.runner.argvs[2:-1] == [(*pip, *step) for step in installs]
        finally:
            h.close()


def test_an_engine_with_no_recipe_for_this_box_is_refused_before_any_job(tmp_path: Path) -> None:
    """
    A record whose recipes are for CUDA only, on a CPU box: unsupported naming
    install.box, no job, nothing run, the engine not left installing.
    """
    only_cuda = {**TORCHY, "install": {"cuda": [["{sdk}", "{adapter}"]]}}
    h = Harness(tmp_path, records=(only_cuda,), box="cpu")
    try:
        with pytest.raises(Unsupported) as refused:
            h.installer.install("torchy", None, None)
        assert refused.value.field == "install.box"
        assert h.runner.argvs == [] and h.jobs.active("torchy") is None
        assert "torchy" not in h.catalog.installing
    finally:
        h.close()
