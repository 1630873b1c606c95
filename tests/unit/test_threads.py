"""
The core budget (rhapsode_worker._threads): how many cores a worker's onnxruntime runs
may use, the gate that shares them among a process's threads and, through lock files,
among the workers of one core, which session a run goes to, the name an optimised graph
is cached under, and the core's half: the setting, the environment a worker gets, and
prestart.  Nothing here needs onnxruntime (tests/integration/test_threads_live.py runs
real sessions).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.logger import LogLevel, capturedLogs

import rhapsode_worker.onnx
from rhapsode._config import WorkersConfig, load_config
from rhapsode._fleet.supervisor import core_budget_env, prestart
from rhapsode_worker import _threads
from rhapsode_worker._threads import (
    CoreGate,
    core_budget,
    optimised_cache_dir,
    optimised_name,
    session_threads,
    thread_counts,
)

#: How long a thread freed by a release may take to finish: a hang guard, returned from
#: at once when it works (0.2 s is how long a blocked one is watched staying blocked).
HANG_GUARD = 30.0


def test_budget_defaults_to_the_cores_this_process_may_use() -> None:
    """
    With no variable the budget is the process's CPU affinity, not the machine's count.
    """
    assert core_budget({}) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("raw", "cores"), [("1", 1), ("2", 2), (" 8 ", 8), ("", None)])
def test_budget_reads_the_variable(raw: str, cores: int | None) -> None:
    """
    RHAPSODE_WORKER_CORES names the budget; blank means the default.
    """
    expected = cores if cores is not None else len(os.sched_getaffinity(0))
    assert core_budget({"RHAPSODE_WORKER_CORES": raw}) == expected


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5", "\u00b2"])
def test_budget_refuses_anything_but_a_positive_integer(raw: str) -> None:
    """
    A budget that is not a positive integer is an error naming the variable, never a
    silent default.
    """
    with pytest.raises(ValueError, match="RHAPSODE_WORKER_CORES"):
        core_budget({"RHAPSODE_WORKER_CORES": raw})


@pytest.mark.parametrize(("cores", "counts"), [(1, (1,)), (2, (1, 2)), (8, (1, 8))])
def test_a_session_is_made_for_the_whole_budget_and_for_one_thread(cores: int, counts: tuple[int, ...]) -> None:
    """
    Two sessions at most: one with every core of the budget, one with a single thread;
    a budget of one makes only one.
    """
    assert thread_counts(cores) == counts


@pytest.mark.parametrize(("tokens", "threads"), [(0, 1), (1, 1), (2, 1), (3, 1), (4, 4), (5, 4)])
def test_a_run_goes_to_the_widest_session_its_cores_pay_for(tokens: int, threads: int) -> None:
    """
    A run with every core runs on the wide session; with fewer, on the one-thread one.
    """
    assert session_threads((1, 4), tokens) == threads


def test_a_lone_run_takes_every_core_and_a_second_gets_what_is_left() -> None:
    """
    The first lease takes the whole budget it asks for; one taken beside it gets what
    is left; after both are released the gate is empty and remembers its peak.
    """
    gate = CoreGate(3)
    first = gate.acquire(2)
    second = gate.acquire(3)
    assert (first.count, second.count) == (2, 1)
    assert set(first.tokens).isdisjoint(second.tokens)
    assert gate.held == 3
    gate.release(first)
    gate.release(second)
    assert gate.held == 0 and gate.peak == 3


def test_shrinking_gives_back_the_cores_a_run_will_not_use() -> None:
    """
    A run that keeps one of two cores leaves the other for the next run.
    """
    gate = CoreGate(2)
    lease = gate.acquire(2)
    gate.shrink(lease, 1)
    assert lease.count == 1 and gate.held == 1
    assert gate.acquire(2).count == 1


def test_a_run_waits_while_every_core_is_taken() -> None:
    """
    With the budget spent, a run blocks until one is released, and then takes it.
    """
    gate = CoreGate(1)
    lease = gate.acquire(1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(gate.acquire(1).count))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []
    gate.release(lease)
    waiter.join(HANG_GUARD)
    assert got == [1]
    assert gate.peak == 1


def test_a_run_that_waited_takes_one_core_even_with_more_free() -> None:
    """
    A run that found every core taken takes one when they come back, leaving the rest
    for the run it waited for, so that the two share the cores rather than take turns
    with all of them.
    """
    gate = CoreGate(2)
    first, second = gate.acquire(1), gate.acquire(1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(gate.acquire(2).count))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    gate.release(first)
    gate.release(second)
    waiter.join(HANG_GUARD)
    assert got == [1]
    assert gate.acquire(2).count == 1


def test_a_newcomer_beside_a_wide_run_of_its_worker_is_lent_a_thread() -> None:
    """
    A run that finds every core held by one wide run of the same process does not wait
    for that run: it is lent one thread (no core token); while the loan lasts the next
    run takes one core, not all; once it is repaid a run alone takes every core again.
    """
    gate = CoreGate(2)
    wide = gate.acquire(2)
    lent = gate.acquire(2)
    assert (lent.borrowed, lent.count, lent.tokens) == (True, 1, [])
    assert gate.held == 2
    gate.release(wide)
    assert gate.acquire(2).count == 1  # the loan is still out
    gate.release(lent)
    assert not lent.borrowed


class _Options:
    """
    What the gate touches of onnxruntime's RunOptions.
    """

    terminate = False


def test_a_newcomer_stops_a_young_wide_run_and_they_share_the_cores() -> None:
    """
    A run that finds every core held by a wide run of this process taken less than
    CUT_SECONDS ago sets that run's terminate flag and waits for its cores rather than
    being lent a thread; once the stopped run gives them back the newcomer takes one,
    and the stopped run, asking again, the other.
    """
    gate = CoreGate(2)
    options = _Options()
    wide = gate.acquire(2, options)
    got: list[Any] = []
    newcomer = threading.Thread(target=lambda: got.append(gate.acquire(2)))
    newcomer.start()
    newcomer.join(0.2)
    assert newcomer.is_alive() and options.terminate and wide.cut
    gate.release(wide)
    newcomer.join(HANG_GUARD)
    assert (got[0].count, got[0].borrowed) == (1, False)
    again = gate.acquire(1)
    assert again.count == 1 and gate.held == 2


def test_an_older_wide_run_or_one_without_options_is_not_stopped() -> None:
    """
    A wide run older than CUT_SECONDS, or one whose options were not given, runs on: the
    newcomer is lent a thread beside it, as before.
    """
    gate = CoreGate(2)
    options = _Options()
    old = gate.acquire(2, options)
    old.started -= _threads.CUT_SECONDS
    lent = gate.acquire(2)
    assert lent.borrowed and not options.terminate and not old.cut
    gate.release(lent)
    gate.release(old)
    bare = gate.acquire(2)
    assert gate.acquire(2).borrowed and not bare.cut


def test_no_thread_is_lent_beside_narrow_runs_or_another_workers() -> None:
    """
    Runs of one thread each, or a wide run of another worker (another gate on the same
    lock folder), are waited for: nothing is lent.
    """
    gate = CoreGate(2)
    leases = [gate.acquire(1), gate.acquire(1)]
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(gate.acquire(1).borrowed))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    gate.release(leases[0])
    waiter.join(HANG_GUARD)
    assert got == [False]


def test_many_threads_never_hold_more_than_the_budget() -> None:
    """
    Eight threads taking and releasing leases over and over never hold more cores at
    once than the budget.
    """
    gate = CoreGate(2)
    over: list[int] = []

    def work() -> None:
        for _ in range(50):
            lease = gate.acquire(2)
            if gate.held > 2:
                over.append(gate.held)
            gate.release(lease)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert over == [] and gate.peak <= 2 and gate.held == 0


def test_gates_sharing_a_folder_share_the_cores(tmp_path: Path) -> None:
    """
    Two gates on one lock folder (as two workers of one core are) never hand out the
    same core: what one holds the other cannot take until it is released.
    """
    one = CoreGate(2, tmp_path / "cores")
    other = CoreGate(2, tmp_path / "cores")
    lease = one.acquire(2)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(other.acquire(2).count))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "the other gate took a core the first one holds"
    one.shrink(lease, 1)
    waiter.join(HANG_GUARD)
    assert got == [1]
    assert sorted(os.listdir(tmp_path / "cores")) == ["core-0", "core-1"]


def test_a_dead_process_keeps_no_core(tmp_path: Path) -> None:
    """
    A worker killed while it held a core lets it go: the kernel drops its lock, so the
    core is taken again at once.
    """
    folder = tmp_path / "cores"
    script = (
        "import sys, time; from pathlib import Path; "
        "from rhapsode_worker._threads import CoreGate; "
        "lease = CoreGate(1, Path(sys.argv[1])).acquire(1); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        gate = CoreGate(1, folder)
        blocked: list[int] = []
        attempt = threading.Thread(target=lambda: blocked.append(gate.acquire(1).count), daemon=True)
        attempt.start()
        attempt.join(0.2)
        assert attempt.is_alive(), "a core held by a live process was taken"
        holder.kill()
        holder.wait(10)
        attempt.join(HANG_GUARD)
        assert blocked == [1]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_one_gate_per_budget_and_folder_in_a_process() -> None:
    """
    Every session of a worker shares one gate: asked twice for the same environment,
    process_gate answers the same gate, and another budget gets another.
    """
    environ = {"RHAPSODE_WORKER_CORES": "3"}
    assert _threads.process_gate(environ) is _threads.process_gate(dict(environ))
    assert _threads.process_gate({"RHAPSODE_WORKER_CORES": "5"}).cores == 5


def test_the_optimised_graph_cache_is_configurable(tmp_path: Path) -> None:
    """
    RHAPSODE_WORKER_ONNX_CACHE names the cache's folder or turns it off; by default it
    is under XDG_CACHE_HOME.
    """
    assert optimised_cache_dir({"RHAPSODE_WORKER_ONNX_CACHE": str(tmp_path)}) == tmp_path
    assert optimised_cache_dir({"RHAPSODE_WORKER_ONNX_CACHE": "off"}) is None
    assert optimised_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "rhapsode" / "onnx"


def test_an_optimised_graph_is_never_reused_for_another_model_runtime_or_setting(tmp_path: Path) -> None:
    """
    The cached graph's name changes with the model file's contents (size and time),
    onnxruntime's version and the session settings, so a stale graph is never read.
    """
    model = tmp_path / "voice.onnx"
    model.write_bytes(b"graph")
    name = optimised_name(model, "1.32.0")
    assert name == optimised_name(model, "1.32.0") and name.startswith("voice-")
    assert optimised_name(model, "1.33.0") != name
    assert optimised_name(model, "1.32.0", "arena off") != name
    stat = model.stat()
    model.write_bytes(b"another graph")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert optimised_name(model, "1.32.0") != name


def test_the_sdk_exports_the_budgeted_session() -> None:
    """
    An adapter imports the mechanism from the SDK's public module for ONNX engines,
    rhapsode_worker.onnx, as docs/writing-an-engine.md says.
    """
    for name in ("BudgetedSession", "CoreGate", "core_budget"):
        assert name in rhapsode_worker.onnx.__all__
        assert getattr(rhapsode_worker.onnx, name) is getattr(_threads, name)


def test_the_core_budget_setting_defaults_to_the_machine_and_is_checked(tmp_path: Path) -> None:
    """
    workers.cores defaults to the cores the core may run on (counted when a worker is
    spawned), reads a positive integer,
    and refuses zero naming the key; workers.prestart defaults to off.
    """
    assert WorkersConfig().cores is None and WorkersConfig().prestart is False
    assert core_budget_env(None, Path("/s"))["RHAPSODE_WORKER_CORES"] == str(len(os.sched_getaffinity(0)))
    path = tmp_path / "rhapsode.json"
    path.write_text('{"workers": {"cores": 3, "prestart": true}}')
    workers = load_config(path).workers
    assert (workers.cores, workers.prestart) == (3, True)
    path.write_text('{"workers": {"cores": 0}}')
    with pytest.raises(Exception, match="workers.cores"):
        load_config(path)


def test_each_worker_is_told_the_budget_and_the_shared_lock_folder(tmp_path: Path) -> None:
    """
    The environment the core gives every worker names the same budget and the same lock
    folder, under the socket folder, so that all of them share the cores.
    """
    assert core_budget_env(3, tmp_path) == {
        "RHAPSODE_WORKER_CORES": "3",
        "RHAPSODE_WORKER_CORE_DIR": str(tmp_path / "cores"),
    }


class _Handle:
    def __init__(self, engine: str, remote: bool, fails: bool = False) -> None:
        self.id = engine
        self._remote = remote
        self._fails = fails
        self.asked = 0

    @property
    def remote(self) -> bool:
        return self._remote

    async def capabilities(self) -> dict[str, Any]:
        self.asked += 1
        if self._fails:
            raise RuntimeError("no such module")
        return {"id": self.id}


def test_prestart_starts_local_workers_only_and_logs_a_failure() -> None:
    """
    Prestart asks each local engine for its capabilities (which starts its process and
    loads no model), leaves a remote one alone, and logs a worker that cannot start
    rather than failing the core.
    """
    local, remote, broken = _Handle("tone", False), _Handle("far", True), _Handle("bad", False, fails=True)
    with capturedLogs() as events:
        started = prestart([local, remote, broken])
    assert (local.asked, remote.asked, broken.asked) == (1, 0, 1)
    assert len(started) == 2 and all(isinstance(d, Deferred) and d.called for d in started)
    warnings = [e for e in events if e["log_level"] == LogLevel.warn]
    assert len(warnings) == 1 and warnings[0]["engine"] == "bad"
    assert "no such module" in warnings[0]["why"]


def test_the_cache_keeps_the_last_used_graphs_of_a_model_and_drops_old_partials(tmp_path: Path) -> None:
    """
    Of one model's optimised graphs the three used last are kept and older ones deleted;
    another model's graphs, other files, and a half-written graph younger than an hour
    are left alone; one older than an hour (a crashed writer's) is deleted.
    """
    now = time.time()
    graphs = [tmp_path / f"voice-{i:024x}.onnx" for i in range(5)]
    for age, path in enumerate(graphs):
        path.write_bytes(b"graph")
        os.utime(path, (now - age * 60, now - age * 60))
    other = tmp_path / f"other-{0:024x}.onnx"
    stray = tmp_path / "voice-notes.txt"
    young = tmp_path / f".voice-{9:024x}.onnx.12.34"
    old = tmp_path / f".voice-{8:024x}.onnx.56.78"
    for path in (other, stray, young, old):
        path.write_bytes(b"x")
    os.utime(old, (now - 2 * 3600, now - 2 * 3600))
    deleted = _threads.prune_optimised(tmp_path, "voice")
    assert sorted(deleted) == sorted([graphs[3], graphs[4], old])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [graphs[0].name, graphs[1].name, graphs[2].name, other.name, stray.name, young.name]
    )
