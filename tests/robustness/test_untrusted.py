"""Issue 29, trust nothing: files, clients and specs that lie about their size, layout or values.  Every case
runs in a forked child under RLIMIT_AS and a deadline (``FORK_DRIVER``); an API case ends in one LeakbenchError
line or succeeds, a CLI case exits 2 with one ``error:`` line, and the store is unchanged."""
from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import leakbench as lb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _robust import (  # noqa: E402
    default_sigint,
    CASE_SECONDS,
    ENV,
    FORK_DRIVER,
    GOOD,
    LIMIT_AS,
    _Tuple,
    _assert_one_line,
    _bounded,
    _capped,
    _deep,
    _files,
    _grads_1e300,
    _long_spec,
    _meta_model,
    _model,
    _nan_model,
    _observation,
    _observe,
    _outside_commit,
    _preflight_u,
    _session_alive,
    _store_rows,
    _training,
    _wrong_batch,
    _xy,
    _zero_observation,
)


UNTRUSTED_API = [
    # paths: a store names only files inside its folder
    ("paths", "commit-outside-the-store", _outside_commit, "outside the store's folder"),
    # finite: an observation, a model and a reconstruction are finite, or the call says which is not
    ("finite", "from-gradients-1e300-float64", _grads_1e300, "model's dtype"),
    ("finite", "observe-x-1e300-float64", _observe(x=torch.full((2, 1, 8, 8), 1e300, dtype=torch.float64)),
     "argument x"),
    ("finite", "observe-local-lr-inf", _observe(local_steps=1, local_lr=float("inf")), "local_lr"),
    ("finite", "observe-local-lr-nan", _observe(local_steps=1, local_lr=float("nan")), "local_lr"),
    ("finite", "observe-local-lr-1e38-overflows", _observe(local_steps=3, local_lr=1e38), "field shared"),
    ("finite", "observe-noise-1e308", _observe(defense="noise:1e308"), "field shared"),
    ("finite", "observe-nan-weights", lambda u: lb.observe(_nan_model(), *_xy()), "argument model"),
    ("finite", "observe-weights-nan-model", lambda u: lb.observe_weights(_nan_model()), "argument model"),
    ("finite", "from-update-nan-model", lambda u: lb.Observation.from_update(_nan_model(), _model(), batch_size=1,
                                                                            lr=0.1), "argument model"),
    ("finite", "observation-nan-shared", _observation(lambda o: {"shared": [s * float("nan") for s in o.shared]}),
     "field shared"),
    ("finite", "fc-inversion-zero-gradient", lambda u: lb.attack("fc-inversion", _zero_observation()),
     "reconstruction"),
    ("finite", "cocktail-party-zero-gradient", lambda u: lb.attack("cocktail-party", _zero_observation(),
                                                                   preset="quick"), "reconstruction"),
    # shapes: compared before arithmetic
    ("shapes", "observation-broadcastable-shared", _observation(lambda o: {"shared": [s[..., :1] for s in o.shared]}),
     "shape"),
    ("shapes", "observation-labels-wrong-length", _observation(lambda o: {"labels": torch.tensor([1, 2, 3])}),
     "field labels"),
    ("shapes", "from-gradients-broadcastable", lambda u: lb.Observation.from_gradients(
        _model(), [torch.zeros(1) if p.dim() == 1 else torch.zeros_like(p) for p in _model().parameters()],
        batch_size=1), "shape"),
    ("shapes", "compare-broadcastable", lambda u: lb.compare(torch.zeros(2, 1, 8, 1), *_xy()), "shape"),
    # formats: a layout read wrongly is refused with the fix
    ("formats", "folder-animated-gif", lambda u: lb.load("folder", root=u / "gif"), "frames"),
    ("formats", "folder-tiff-stack", lambda u: lb.load("folder", root=u / "tiffstack"), "frames"),
    ("formats", "folder-cmyk-jpeg", lambda u: lb.load("folder", root=u / "cmyk"), "mode CMYK"),
    ("formats", "folder-lab-tiff", lambda u: lb.load("folder", root=u / "lab"), "mode LAB"),
    ("formats", "cifar-wrong-shape", lambda u: lb.load("cifar10", root=u / "cifar-shape"), "N×3072"),
    ("formats", "cifar-labels-out-of-range", lambda u: lb.load("cifar10", root=u / "cifar-labels"), "labels 0..9"),
    ("formats", "cifar-object-data", lambda u: lb.load("cifar10", root=u / "cifar-object"), "CIFAR"),
    ("formats", "npz-ambiguous-channel-axis", lambda u: lb.load("npz", path=u / "ambiguous.npz"), "layout="),
    ("formats", "mnist-short-body", lambda u: lb.load("mnist", root=u / "mnist-short"), "re-download"),
    ("formats", "model-file-sparse", _files("read_state", "sparse.pt"), "dense"),
    # work: nothing a file, a client or a spec says sizes memory or time without a bound
    ("work", "npz-declares-4gb", lambda u: lb.load("npz", path=u / "bomb.npz"), "field x"),
    ("work", "npz-unused-huge-array", lambda u: lb.load("npz", path=u / "unused.npz"), None),
    ("work", "mnist-gz-bomb", lambda u: lb.load("mnist", root=u / "mnist"), "declares shape"),
    ("work", "model-file-expanded-tensor", _files("read_state", "tera.pt"), "expanded"),
    ("work", "model-file-expanded-weights", _files("load_weights", "expanded.pt"),
     "expanded"),
    ("work", "load-model-huge-spec", _files("load_model", "hugemeta.pt"), "metadata"),
    ("work", "load-model-huge-shape", _files("load_model", "hugeshape.pt"), "input_shape"),
    ("work", "folder-fifo", lambda u: lb.load("folder", root=u / "fifo"), "FIFO"),
    ("work", "folder-10000x10000-png", lambda u: lb.load("folder", root=u / "bigpng", size=8), "pixels"),
    ("work", "preflight-iterations-1e12", lambda u: _preflight_u(u, "iterations-1e12"), "options.iterations"),
    ("work", "preflight-restarts-1e9", lambda u: _preflight_u(u, "restarts-1e9"), "options.restarts"),
    ("work", "preflight-steps-product", lambda u: _preflight_u(u, "steps-product"), "budget.trial_seconds"),
    ("work", "preflight-training-epochs-1e9", lambda u: _preflight_u(u, "epochs-1e9"), "training.epochs"),
    ("work", "preflight-utility-epochs-1e9", lambda u: _preflight_u(u, "utility-epochs-1e9"), "utility.epochs"),
    ("work", "workers-10000-capped", lambda u: _capped(u), None),
    ("work", "ray-unreachable", lambda u: lb.evaluate(GOOD, u / "ray.db", ray="127.0.0.1:1"), "cannot connect"),
    # flower: a client's counts are its word
    ("flower", "examples-1e9", _training(**{"num-examples": 10**9}), "at most"),
    ("flower", "local-steps-1e9", _training(**{"local-steps": 10**9}), "at most"),
    ("flower", "local-epochs-1e9", _training(**{"local-epochs": 10**9}), "at most"),
    ("flower", "examples-nan", _training(**{"num-examples": float("nan")}), "num-examples"),
    ("flower", "update-from-another-batch", _wrong_batch, "does not fit"),
    # tracebacks: one line instead
    ("traceback", "spec-seed-2-63", lambda u: lb.evaluation.load_spec(u / "seed-2-63.yaml"), "seeds"),
    ("traceback", "spec-threads-2-40", lambda u: lb.evaluation.load_spec(u / "threads-2-40.yaml"), "threads"),
    ("traceback", "spec-nested-5000", lambda u: lb.evaluation.load_spec(u / "nested.yaml"), "nested"),
    ("traceback", "spec-nested-mapping", lambda u: lb.evaluation.load_spec(_deep({**GOOD}, 5000)), "nested"),
    ("traceback", "observe-0d-label", _observe(y=torch.tensor(3)), "argument y"),
    ("traceback", "observe-model-returns-tuple", lambda u: lb.observe(_Tuple(), *_xy()), "tuple"),
    ("traceback", "observe-meta-model", lambda u: lb.observe(_meta_model(), *_xy()), "meta"),
    ("traceback", "observe-meta-batch", _observe(x=torch.empty(2, 1, 8, 8, device="meta")), "meta"),
]




@pytest.fixture(scope="module")
def untrusted_api(w, u):
    before = _store_rows(w / "store.db")
    names = [c[1] for c in UNTRUSTED_API]
    proc, left = _bounded([sys.executable, "-c", FORK_DRIVER, "api", str(LIMIT_AS), str(CASE_SECONDS), __file__,
                           str(u)], json.dumps(names), u)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(names, json.loads(proc.stdout.splitlines()[-1]))), left, before, _store_rows(w / "store.db")


@pytest.mark.parametrize("cls, case, call, fragment", UNTRUSTED_API, ids=[f"{c[0]}:{c[1]}" for c in UNTRUSTED_API])
def test_untrusted_api(untrusted_api, cls, case, call, fragment):
    results, left, before, after = untrusted_api
    r = results[case]
    assert not left and before == after
    if fragment is None:
        assert r["ok"], f"{case}: {r.get('traceback')}"
        return
    assert not r["ok"], f"{case}: accepted"
    assert r["leakbench"] and r["value_error"], f"{case}: {r['type']}: {r['message']}\n{r['traceback']}"
    assert "\n" not in r["message"] and fragment in r["message"], f"{case}: {r['message']}"


# (class, case id, argv with {w} (robustness folder) and {u} (issue-29 files), fragment of the one error line)
UNTRUSTED_CLI = [
    ("formats", "attack-sparse-model-file", "attack --data digits --model mlp:8 --model-file {u}/sparse.pt "
                                            "--attack fc-inversion --out {u}/o2", "dense"),
    ("formats", "attack-animated-gif", "attack --data folder --data-option root={u}/gif --model mlp:8 "
                                       "--attack fc-inversion --out {u}/o2", "frames"),
    ("work", "attack-npz-bomb", "attack --data npz --data-option path={u}/bomb.npz --model mlp:8 --out {u}/o2",
     "field x"),
    ("work", "attack-mnist-gz-bomb", "attack --data mnist --data-option root={u}/mnist --model mlp:8 --out {u}/o2",
     "declares shape"),
    ("work", "attack-fifo", "attack --data folder --data-option root={u}/fifo --model mlp:8 --out {u}/o2", "FIFO"),
    ("work", "attack-expanded-model-file", "attack --data digits --model mlp:8 --model-file {u}/expanded.pt "
                                           "--attack fc-inversion --out {u}/o2", "expanded"),
    ("work", "dry-iterations-1e12", "evaluate {u}/iterations-1e12.yaml --dry-run", "options.iterations"),
    ("work", "dry-restarts-1e9", "evaluate {u}/restarts-1e9.yaml --dry-run", "options.restarts"),
    ("work", "dry-training-epochs-1e9", "evaluate {u}/epochs-1e9.yaml --dry-run", "training.epochs"),
    ("work", "dry-utility-epochs-1e9", "evaluate {u}/utility-epochs-1e9.yaml --dry-run", "utility.epochs"),
    ("work", "evaluate-ray-unreachable", "evaluate {w}/good.yaml --db {u}/ray.db --ray 127.0.0.1:1",
     "cannot connect"),
    ("work", "attack-huge-model", "attack --data digits --model mlp:100000000 --attack fc-inversion --out {u}/o2",
     "at most 4 GiB"),  # sized before it is built (issue 48): refused before any allocation
    ("traceback", "dry-seed-2-63", "evaluate {u}/seed-2-63.yaml --dry-run", "seeds"),
    ("traceback", "run-seed-2-63", "evaluate {u}/seed-2-63.yaml --db {w}/store.db", "seeds"),
    ("traceback", "run-threads-2-40", "evaluate {u}/threads-2-40.yaml --db {w}/store.db", "threads"),
    ("traceback", "spec-nested-5000", "evaluate {u}/nested.yaml --db {w}/store.db", "nested"),
    ("traceback", "attack-non-finite-result", "attack --data digits --model mlp:8 --act relu --model-file "
                                              "{u}/zeros.pt --attack fc-inversion --out {u}/o2", "NaN/inf"),
]



@pytest.fixture(scope="module")
def untrusted_cli(w, u):
    before = _store_rows(w / "store.db")
    argvs = [[p.replace("{w}", str(w)).replace("{u}", str(u)) for p in t.split()] for _, _, t, _ in UNTRUSTED_CLI]
    proc, left = _bounded([sys.executable, "-c", FORK_DRIVER, "cli", str(LIMIT_AS), str(CASE_SECONDS)],
                          json.dumps(argvs), u)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    return dict(zip([c[1] for c in UNTRUSTED_CLI], results)), left, before, _store_rows(w / "store.db")


@pytest.mark.parametrize("cls, case, template, fragment", UNTRUSTED_CLI, ids=[f"{c[0]}:{c[1]}" for c in UNTRUSTED_CLI])
def test_untrusted_cli(untrusted_cli, u, cls, case, template, fragment):
    results, left, before, after = untrusted_cli
    r = results[case]
    _assert_one_line(r["code"], r["stdout"], r["stderr"], fragment, case)
    assert not left and before == after
    assert not (u / "o2").exists()


# --------------------------------------------------------------------------- issue 29: properties of whole runs
def test_untrusted_retry_timed_out_trials_run_again_with_retry_failed(tmp_path):
    slow = {**GOOD, "attacks": [{"name": "inverting-gradients", "options": {"iterations": 200}}]}
    db = tmp_path / "r.db"
    assert lb.evaluate({**slow, "budget": {"trial_seconds": 1e-6}}, db).counts == {"timed out": 2}
    assert lb.evaluate(slow, db).ran == 0  # without --retry-failed they stay as they are
    again = lb.evaluate(slow, db, retry_failed=True)  # the budget raised (it is not part of the trial's identity)
    assert again.ran == 2 and again.counts == {"done": 2}


def _grids(out: Path) -> int:
    return len(list((out / "grids").glob("*.png"))) if (out / "grids").is_dir() else 0


def test_untrusted_paths_report_from_another_directory_and_after_moving_the_store(tmp_path, monkeypatch):
    from leakbench.report import write_report

    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    assert lb.evaluate(GOOD, Path("sub") / "r.db").counts == {"done": 2}  # a relative --db
    monkeypatch.chdir(tmp_path / "elsewhere")
    files = write_report(tmp_path / "run" / "sub" / "r.db", tmp_path / "rep1")
    assert files.grids and _grids(tmp_path / "rep1") == len(files.grids)
    assert "No reconstructions saved" not in files.index.read_text()
    shutil.move(tmp_path / "run" / "sub", tmp_path / "moved")
    files = write_report(tmp_path / "moved" / "r.db", tmp_path / "rep2")
    assert files.grids and "No reconstructions saved" not in files.index.read_text()


def test_untrusted_paths_a_file_outside_the_store_is_refused_for_its_row(tmp_path):
    from leakbench.report import write_report

    db = tmp_path / "store" / "r.db"
    assert lb.evaluate(GOOD, db).counts == {"done": 2}
    secret = tmp_path / "secret" / "s.npz"
    secret.parent.mkdir()
    x = np.random.default_rng(1).random((1, 1, 8, 8)).astype(np.float32)
    np.savez(secret, x=x, y=np.zeros(1, int), reconstruction=x, order=np.zeros(1, int), labels=np.zeros(1, int))
    with sqlite3.connect(db) as c:
        keys = [r[0] for r in c.execute("SELECT key FROM trials ORDER BY key")]
        c.execute("UPDATE images SET path = ? WHERE key = ? AND kind = 'npz'", (str(secret), keys[0]))
        c.execute("UPDATE images SET path = ? WHERE key = ? AND kind = 'npz'", ("../secret/s.npz", keys[1]))
    with lb.evaluation.Store(db, readonly=True) as store:
        rows = {r["key"]: r for r in store.rows()}
    for key in keys:
        assert rows[key]["npz"] is None and "outside the store's folder" in rows[key]["images_refused"], rows[key]
    files = write_report(db, tmp_path / "rep")
    page = files.index.read_text()
    assert not files.grids and "not shown" in page and "outside the store" in page
    assert "Files refused" in page and str(secret) in page and "../secret/s.npz" in page


def test_untrusted_terminal_escapes_markup_and_control_characters(w, u, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "leakbench.cli", "evaluate", str(u / "label-markup.yaml"), "--db",
                           str(tmp_path / "t.db"), "--report", str(tmp_path / "rep")], capture_output=True, text=True,
                          env=ENV, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert "\x1b" not in out and "\x07" not in out  # no escape sequence of the spec reaches the terminal
    assert "[/x]" in out and "\\x1b" in out  # the label is shown as text, its control characters as escapes
    assert (tmp_path / "rep" / "index.html").is_file()


def test_untrusted_traceback_report_of_a_store_with_malformed_json(tmp_path):
    db = tmp_path / "r.db"
    assert lb.evaluate(GOOD, db).counts == {"done": 2}
    with sqlite3.connect(db) as c:
        c.execute("UPDATE results SET metrics = '{\"mse\": [' WHERE rowid = 1")
        c.execute("UPDATE trials SET spec = 'not json', batch_size = 'four', seed = x'00ff' WHERE rowid = 2")
        c.execute("UPDATE results SET psnr = 'high', seconds = 'slow' WHERE rowid = 2")
    proc = subprocess.run([sys.executable, "-m", "leakbench.cli", "report", str(db), "--out", str(tmp_path / "rep")],
                          capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    with lb.evaluation.Store(db, readonly=True) as store:
        damaged = [r["damaged"] for r in store.rows() if r.get("damaged")]
    assert sorted(damaged) == ["metrics", "spec"]


def _wait_for_sigint_handler(proc: subprocess.Popen, limit: float = 60.0) -> None:
    """Until the child has loaded numpy or torch (its /proc maps): leakbench installs its Ctrl-C hook before importing
    either, and torch then takes seconds.  A signal sent earlier (between fork and exec, or while the interpreter
    imports ``site``) is lost or fatal; a fixed 0.3 s sleep was once too short on a loaded machine."""
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():   # no /proc: the start-up takes seconds, 0.3 s is inside it
        time.sleep(0.3)
        return
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        try:
            if any(name in maps.read_text() for name in ("/numpy/", "/torch/")):
                return
        except OSError:   # the process is between fork and exec, or gone
            pass
        time.sleep(0.005)


@pytest.mark.parametrize("entry", ["module", "script"])
def test_untrusted_traceback_ctrl_c_during_start_up_exits_130(w, entry):
    script = Path(sys.executable).parent / "leakbench"
    if entry == "script" and not script.is_file():
        pytest.skip("no leakbench console script beside this Python")
    argv = [sys.executable, "-m", "leakbench.cli"] if entry == "module" else [str(script)]
    proc = subprocess.Popen([*argv, "evaluate", str(w / "good.yaml"), "--dry-run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=w, preexec_fn=default_sigint)
    _wait_for_sigint_handler(proc)  # still importing torch (seconds): the signal lands before any command runs
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out + err, err
    assert [line for line in err.splitlines() if line.strip()] == ["interrupted"]


@pytest.mark.slow  # ~15 s: `make test-slow`; tests/evaluation/running/test_processes.py keeps a killed sweep's
# workers and its resume in the default suite
def test_untrusted_work_workers_die_with_a_parent_killed_while_they_start(w, tmp_path):
    spec = _long_spec(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "leakbench.cli", "evaluate", str(spec), "--db",
                             str(tmp_path / "k.db"), "--workers", "2", "-q"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV, cwd=tmp_path, start_new_session=True)
    deadline = time.time() + 120
    children: list[str] = []
    while time.time() < deadline and not children and proc.poll() is None:
        ps = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
        children = ps.split()
    assert children, "no worker started"
    proc.kill()  # kill -9 of the sweep while its workers are still starting
    proc.wait()
    deadline = time.time() + 60
    while time.time() < deadline and _session_alive(proc.pid):
        time.sleep(0.1)
    assert not _session_alive(proc.pid)
