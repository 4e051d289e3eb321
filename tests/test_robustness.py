"""Robustness: bad input gets one line naming the field, never a traceback, and loses nothing (issue 14).

Two tables feed the same bad inputs through the two front doors:

- ``CLI_CASES`` run in a separate Python process (``python -c`` importing ``leakbench.cli:app``, one
  process for the whole table, each case with its own argv, stdout and stderr; two cases also run
  alone through ``python -m leakbench.cli`` for the real exit status): exit code 2, exactly one
  ``error: ...`` line on stderr naming the field, no "Traceback", and the existing results store
  byte-for-byte the same rows afterwards;
- ``API_CASES`` call the library: a ``ValueError`` subclass whose message is one line naming the field.
"""
from __future__ import annotations

import json
import os
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
import yaml

import leakbench as lb
from leakbench.errors import ConfigError, LeakbenchError

GOOD = {"name": "robust", "datasets": [{"name": "digits"}], "models": [{"spec": "mlp:8", "act": "relu"}],
        "batch_sizes": [1], "images": 2, "attacks": [{"name": "fc-inversion"}]}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                    os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}


def _spec(w: Path, name: str, text: str | bytes | dict) -> Path:
    path = w / f"{name}.yaml"
    if isinstance(text, dict):
        text = yaml.safe_dump(text, sort_keys=False)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _bomb(levels: int = 8, width: int = 9) -> str:
    lines = ['a0: &a0 ["lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\ndatasets: [digits]\nmodels: [mlp:4]\nbatch_sizes: [1]\nattacks: [dlg]\n" \
                              f"description: *a{levels}\n"


def _png(path: Path, value: int) -> None:
    from skimage.io import imsave

    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, np.full((8, 8), value, dtype=np.uint8), check_contrast=False)


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> Path:
    """A work folder with a finished results store and every bad file the tables refer to."""
    w = tmp_path_factory.mktemp("robust")
    summary = lb.evaluate(GOOD, w / "store.db")
    assert summary.counts == {"done": 2}
    x = np.random.default_rng(0).random((4, 8, 8)).astype(np.float32)
    labels = np.array([0, 1, 0, 1])
    np.savez(w / "good.npz", x=x, y=labels)
    np.savez(w / "nan.npz", x=np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x), y=labels)
    np.savez(w / "inf.npz", x=np.where(np.arange(x.size).reshape(x.shape) == 5, np.inf, x), y=labels)
    np.savez(w / "oneclass.npz", x=x, y=np.zeros(4, int))
    np.savez(w / "hugelabel.npz", x=x, y=np.array([0, 1, 0, 10**9]))
    np.savez(w / "pickled.npz", x=np.array([{"a": 1}] * 4, dtype=object), y=labels)
    raw = (w / "good.npz").read_bytes()
    (w / "trunc.npz").write_bytes(raw[: len(raw) // 2])
    (w / "notzip.npz").write_text("x,y\n1,2\n")
    for i in range(2):
        _png(w / "emptyclass" / "cat" / f"{i}.png", 40 * i)
        _png(w / "oneclass" / "only" / f"{i}.png", 40 * i)
    (w / "emptyclass" / "dog").mkdir()
    (w / "afile").write_text("not a directory\n")
    (w / "dir.db").mkdir()
    (w / "dir.yaml").mkdir()
    with sqlite3.connect(w / "foreign.db") as c:
        c.execute("CREATE TABLE customers (id INTEGER, name TEXT)")
    with sqlite3.connect(w / "wrongschema.db") as c:
        c.execute("CREATE TABLE meta (name TEXT, value TEXT)")
        c.execute("CREATE TABLE trials (id INTEGER)")
    (w / "garbage.db").write_bytes(b"SQLite format 2\0" + os.urandom(2000))
    shutil.copy(w / "store.db", w / "copy.db")
    with sqlite3.connect(w / "copy.db") as c:  # fold the WAL in, then cut the file
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.execute("PRAGMA journal_mode = DELETE")
    data = (w / "copy.db").read_bytes()
    (w / "trunc.db").write_bytes(data[: len(data) // 2 + 100])
    (w / "empty.db").write_bytes(b"")
    specs = {
        "good": GOOD,
        "other": {**GOOD, "images": 3},
        "nonutf8": b"name: caf\xe9\ndatasets: [digits]\n",
        "bomb": _bomb(),
        "recursive": "a: &a [*a]\n",
        "notmapping": "- just\n- a list\n",
        "badyaml": "datasets: [digits\n",
        "huge": {**GOOD, "images": 100_000},
        "hugeseeds": {**GOOD, "seeds": list(range(20_000))},
        "emptygrid": {**GOOD, "defenses": ["none", {"noise": []}]},
        "excludetypo": {**GOOD, "exclude": [{"attack": "dgl"}]},
        "includetypo": {**GOOD, "include": [{"defense": "prnue"}]},
        "emptyrule": {**GOOD, "exclude": [{}]},
        "excludeall": {**GOOD, "exclude": [{"attack": "fc-inversion"}]},
        "badoption": {**GOOD, "attacks": [{"name": "inverting-gradients", "preset": "quick",
                                           "options": {"iterations": -5}}]},
        "badoptiontype": {**GOOD, "attacks": [{"name": "inverting-gradients", "preset": "quick",
                                               "options": {"iterations": "many"}}]},
        "relux": {**GOOD, "models": [{"spec": "mlp:8", "act": "relux"}]},
        "sizebig": {**GOOD, "datasets": [{"name": "digits", "options": {"size": "big"}}]},
        "sizehuge": {**GOOD, "datasets": [{"name": "digits", "options": {"size": 100_000}}]},
        "cnn99": {**GOOD, "models": ["cnn:99-1-1-0"]},
        "missingnpz": {**GOOD, "datasets": [{"name": "npz", "options": {"path": str(w / "absent.npz")}}]},
        "missingfolder": {**GOOD, "datasets": [{"name": "folder", "options": {"root": str(w / "absent")}}]},
        "nanspec": {**GOOD, "datasets": [{"name": "npz", "options": {"path": str(w / "nan.npz")}}]},
        "logistic": {**GOOD, "threat": {"loss": "logistic"}},
        "toofew": {**GOOD, "datasets": [{"name": "digits", "options": {"limit": 1}}]},
        "templatetypo": {**GOOD, "defenses": [{"spec": "noise:{s}", "grid": {"sigma": [0.1]}}]},
    }
    for name, text in specs.items():
        _spec(w, name, text)
    return w


def _store_rows(db: Path) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        trials = c.execute("SELECT key, status, attempts, spec FROM trials ORDER BY key").fetchall()
        results = c.execute("SELECT key, mse, psnr, metrics FROM results ORDER BY key").fetchall()
        meta = c.execute("SELECT name, value FROM meta ORDER BY name").fetchall()
    return trials + results + meta


# --------------------------------------------------------------------------- the CLI table
# (case id, argv with {w} for the work folder, fragment the one error line must contain)
CLI_CASES = [
    # data (through `leakbench attack`, which loads the data first)
    ("npz-nan", "attack --data npz --data-option path={w}/nan.npz --model mlp:8 --out {w}/o1", "NaN/inf"),
    ("npz-inf", "attack --data npz --data-option path={w}/inf.npz --model mlp:8 --out {w}/o1", "NaN/inf"),
    ("npz-one-class", "attack --data npz --data-option path={w}/oneclass.npz --model mlp:8 --out {w}/o1",
     "at least 2 classes"),
    ("npz-huge-label", "attack --data npz --data-option path={w}/hugelabel.npz --model mlp:8 --out {w}/o1",
     "field y"),
    ("npz-truncated", "attack --data npz --data-option path={w}/trunc.npz --model mlp:8 --out {w}/o1",
     "cannot read"),
    ("npz-not-zip", "attack --data npz --data-option path={w}/notzip.npz --model mlp:8 --out {w}/o1",
     "cannot read"),
    ("npz-pickled", "attack --data npz --data-option path={w}/pickled.npz --model mlp:8 --out {w}/o1",
     "cannot read"),
    ("npz-missing", "attack --data npz --data-option path={w}/absent.npz --model mlp:8 --out {w}/o1",
     "not found"),
    ("folder-empty-class", "attack --data folder --data-option root={w}/emptyclass --model mlp:8 --out {w}/o1",
     "dog holds no images"),
    ("folder-one-class", "attack --data folder --data-option root={w}/oneclass --model mlp:8 --out {w}/o1",
     "at least 2 classes"),
    ("digits-size-100000", "attack --data digits --data-option size=100000 --model mlp:8 --out {w}/o1",
     "field size"),
    ("digits-size-word", "attack --data digits --data-option size=big --model mlp:8 --out {w}/o1", "size"),
    ("sphere-n-1e10", "attack --data sphere --data-option n=10000000000 --model mlp:8 --out {w}/o1", "field n"),
    # observe() (through `leakbench attack`)
    ("logistic-10-class", "attack --data digits --model mlp:8 --loss logistic --attack fc-inversion --out {w}/o1",
     "argument loss"),
    ("indices-out-of-range", "attack --data digits --model mlp:8 --indices 99999 --out {w}/o1", "field indices"),
    ("batch-size-too-big", "attack --data digits --data-option limit=3 --model mlp:8 --batch-size 4 --out {w}/o1",
     "field size"),
    # outputs, checked before any work
    ("attack-out-is-file", "attack --data digits --model mlp:8 --attack fc-inversion --out {w}/afile", "--out"),
    ("attack-out-dev-null", "attack --data digits --model mlp:8 --attack fc-inversion --out /dev/null", "--out"),
    ("attack-out-under-file", "attack --data digits --model mlp:8 --attack fc-inversion --out {w}/afile/sub",
     "--out"),
    ("attack-out-not-writable", "attack --data digits --model mlp:8 --attack fc-inversion --out /sys/leakbench-out",
     "cannot write into --out"),
    ("evaluate-report-is-file", "evaluate {w}/good.yaml --db {w}/store.db --report {w}/afile", "--report"),
    ("report-out-is-file", "report {w}/store.db --out {w}/afile", "--out"),
    ("report-out-dev-null", "report {w}/store.db --out /dev/null", "--out"),
    # results stores
    ("evaluate-foreign-db", "evaluate {w}/good.yaml --db {w}/foreign.db", "another program"),
    ("evaluate-garbage-db", "evaluate {w}/good.yaml --db {w}/garbage.db", "not a readable leakbench store"),
    ("evaluate-truncated-db", "evaluate {w}/good.yaml --db {w}/trunc.db", "not a readable leakbench store"),
    ("evaluate-wrong-schema-db", "evaluate {w}/good.yaml --db {w}/wrongschema.db", "without column"),
    ("evaluate-other-spec", "evaluate {w}/other.yaml --db {w}/store.db", "another sweep"),
    ("evaluate-db-dev-null", "evaluate {w}/good.yaml --db /dev/null", "--db"),
    ("evaluate-db-is-dir", "evaluate {w}/good.yaml --db {w}/dir.db", "--db"),
    ("report-foreign-db", "report {w}/foreign.db --out {w}/rep", "another program"),
    ("report-garbage-db", "report {w}/garbage.db --out {w}/rep", "not a readable leakbench store"),
    ("report-truncated-db", "report {w}/trunc.db --out {w}/rep", "not a readable leakbench store"),
    ("report-wrong-schema-db", "report {w}/wrongschema.db --out {w}/rep", "without column"),
    ("report-empty-db", "report {w}/empty.db --out {w}/rep", "no leakbench results"),
    ("report-missing-db", "report {w}/absent.db --out {w}/rep", "no such file"),
    # specs (each also against the existing store)
    ("spec-not-utf8", "evaluate {w}/nonutf8.yaml --db {w}/store.db", "UTF-8"),
    ("spec-alias-bomb", "evaluate {w}/bomb.yaml --db {w}/store.db", "alias bomb"),
    ("spec-recursive-alias", "evaluate {w}/recursive.yaml --db {w}/store.db", "recursive"),
    ("spec-not-mapping", "evaluate {w}/notmapping.yaml --db {w}/store.db", "expected a mapping"),
    ("spec-bad-yaml", "evaluate {w}/badyaml.yaml --db {w}/store.db", "not valid YAML"),
    ("spec-is-dir", "evaluate {w}/dir.yaml --db {w}/store.db", "no such file"),
    ("spec-missing", "evaluate {w}/absent.yaml --db {w}/store.db", "no such file"),
    ("spec-images-100000", "evaluate {w}/huge.yaml --db {w}/store.db", "max_trials"),
    ("spec-images-100000-dry", "evaluate {w}/huge.yaml --dry-run", "100,000 trials"),
    ("spec-seeds-20000", "evaluate {w}/hugeseeds.yaml --dry-run", "max_trials"),
    ("spec-empty-grid", "evaluate {w}/emptygrid.yaml --db {w}/store.db", "defenses[1]"),
    ("spec-exclude-typo", "evaluate {w}/excludetypo.yaml --db {w}/store.db", "exclude[0].attack"),
    ("spec-include-typo", "evaluate {w}/includetypo.yaml --db {w}/store.db", "include[0].defense"),
    ("spec-empty-rule", "evaluate {w}/emptyrule.yaml --db {w}/store.db", "exclude[0]"),
    ("spec-exclude-all", "evaluate {w}/excludeall.yaml --db {w}/store.db", "plans no trial"),
    ("spec-bad-option-value", "evaluate {w}/badoption.yaml --db {w}/store.db", "attacks[0].options.iterations"),
    ("spec-bad-option-type", "evaluate {w}/badoptiontype.yaml --db {w}/store.db", "attacks[0].options.iterations"),
    ("spec-template-typo", "evaluate {w}/templatetypo.yaml --db {w}/store.db", "defenses[0]"),
    # what only building and loading reveals: --dry-run must catch it, and so must a real run
    ("dry-act-relux", "evaluate {w}/relux.yaml --dry-run", "models[0]"),
    ("dry-size-big", "evaluate {w}/sizebig.yaml --dry-run", "datasets[0]"),
    ("dry-size-100000", "evaluate {w}/sizehuge.yaml --dry-run", "field size"),
    ("dry-cnn-too-deep", "evaluate {w}/cnn99.yaml --dry-run", "models[0]"),
    ("dry-missing-npz", "evaluate {w}/missingnpz.yaml --dry-run", "datasets[0]"),
    ("dry-missing-folder", "evaluate {w}/missingfolder.yaml --dry-run", "datasets[0]"),
    ("dry-nan-npz", "evaluate {w}/nanspec.yaml --dry-run", "NaN/inf"),
    ("dry-logistic-10-class", "evaluate {w}/logistic.yaml --dry-run", "threat"),
    ("dry-too-few-samples", "evaluate {w}/toofew.yaml --dry-run", "datasets[0]"),
    ("run-act-relux", "evaluate {w}/relux.yaml --db {w}/store.db", "models[0]"),
    ("run-missing-npz", "evaluate {w}/missingnpz.yaml --db {w}/store.db", "datasets[0]"),
    # flags
    ("workers-zero", "evaluate {w}/good.yaml --db {w}/store.db --workers 0", "--workers"),
    ("bad-device", "attack --data digits --model mlp:8 --device cuda:7 --out {w}/o1", "device"),
    ("unknown-attack", "attack --data digits --model mlp:8 --attack dgl --out {w}/o1", "dlg"),
    ("bad-data-option", "attack --data digits --data-option sizee=3 --out {w}/o1", "sizee"),
    ("analyze-bad-shape", "analyze security --model cnn:3-6-1-0 --input-shape 3,-1,32", "--input-shape"),
]

DRIVER = r"""
import contextlib, io, json, sys, traceback
from leakbench.cli import app
out = []
for argv in json.loads(sys.stdin.read()):
    so, se = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        try:
            app(argv, prog_name="leakbench", standalone_mode=True)
        except SystemExit as err:
            code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        except BaseException:
            code = "exception"
            se.write(traceback.format_exc())
    out.append({"code": code, "stdout": so.getvalue(), "stderr": se.getvalue()})
print(json.dumps(out))
"""


def _argv(template: str, w: Path) -> list[str]:
    return [part.replace("{w}", str(w)) for part in template.split()]


def _assert_one_line(code, stdout: str, stderr: str, fragment: str, case: str) -> None:
    assert "Traceback" not in stdout + stderr, f"{case}: {stderr}"
    assert code == 2, f"{case}: exit {code}\n{stdout}\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {stderr}"
    assert fragment in lines[0], f"{case}: {fragment!r} not in {lines[0]!r}"


@pytest.fixture(scope="module")
def cli_results(w):
    """Every CLI case, run in one separate process; the store's rows before and after."""
    before = _store_rows(w / "store.db")
    argvs = [_argv(template, w) for _, template, _ in CLI_CASES]
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(argvs), capture_output=True, text=True,
                          env=ENV, timeout=600, cwd=w)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    return dict(zip([c[0] for c in CLI_CASES], results)), before, _store_rows(w / "store.db")


@pytest.mark.parametrize("case, template, fragment", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_exit_2(cli_results, case, template, fragment):
    results, _, _ = cli_results
    r = results[case]
    _assert_one_line(r["code"], r["stdout"], r["stderr"], fragment, case)


def test_cli_cases_lose_nothing_from_the_store(cli_results, w):
    _, before, after = cli_results
    assert before == after and len(before) > 2
    assert not (w / "o1").exists()  # no output folder was left behind by a refused attack
    assert (w / "afile").read_text() == "not a directory\n"


@pytest.mark.parametrize("case", ["spec-not-utf8", "attack-out-dev-null"])
def test_the_real_entry_point_exits_2_with_one_line(w, case):
    template, fragment = next((t, f) for c, t, f in CLI_CASES if c == case)
    proc = subprocess.run([sys.executable, "-m", "leakbench.cli", *_argv(template, w)], capture_output=True,
                          text=True, env=ENV, timeout=300, cwd=w)
    _assert_one_line(proc.returncode, proc.stdout, proc.stderr, fragment, case)


FULL_DISK = """
import sqlite3, sys
_connect = sqlite3.connect
def connect(*a, **k):  # the store cannot grow past its current size: SQLite's own "disk full" error
    c = _connect(*a, **k)
    c.execute(f"PRAGMA max_page_count = {max(c.execute('PRAGMA page_count').fetchone()[0], 1)}")
    return c
sqlite3.connect = connect
from leakbench.cli import app
app(sys.argv[1:], prog_name="leakbench")
"""


def test_disk_full_store_is_one_line_and_keeps_the_finished_trials(w, tmp_path):
    db = tmp_path / "full.db"
    shutil.copy(w / "copy.db", db)
    before = _store_rows(db)
    big = _spec(tmp_path, "big", {**GOOD, "images": 150})
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "evaluate", str(big), "--db", str(db), "--force", "-q"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    _assert_one_line(proc.returncode, proc.stdout, proc.stderr, "disk is full", "disk-full")
    after = _store_rows(db)
    assert [r for r in after if r[0] != "plan"] == [r for r in before if r[0] != "plan"]


# --------------------------------------------------------------------------- the API table
def _data(w):
    return lb.load("digits")


def _model():
    return lb.build("mlp:8", input_shape=(1, 8, 8), classes=10, act="relu", seed=0)


def _xy(n=2):
    return lb.load("digits").batch(n, seed=0)


def _observe(**change):
    def run(w):
        x, y = _xy()
        args = {"model": _model(), "x": x, "y": y, **change}
        model, x, y = args.pop("model"), args.pop("x"), args.pop("y")
        return lb.observe(model, x, y, **args)
    return run


def _preflight(name):
    def run(w):
        from leakbench.evaluation.preflight import preflight

        return preflight(lb.evaluation.load_spec(w / f"{name}.yaml"))
    return run


def _spec_load(name):
    return lambda w: lb.evaluation.load_spec(w / f"{name}.yaml")


def _npz(name):
    return lambda w: lb.load("npz", path=w / f"{name}.npz")


def _store(name, **kw):
    return lambda w: lb.evaluation.Store(w / name, **kw)


def _other_spec_on_store(w):
    return lb.evaluate(lb.evaluation.load_spec(w / "other.yaml"), w / "store.db")


def _pickle_target(w):
    from leakbench.models.targets import TrainedTarget

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(w / "pwned"),))

    torch.save({"format": "leakbench-target-1", "x": Payload()}, w / "evil.pt")
    return TrainedTarget.load(w / "evil.pt")


API_CASES = [
    # data
    ("npz-nan", _npz("nan"), "NaN/inf"),
    ("npz-inf", _npz("inf"), "NaN/inf"),
    ("npz-one-class", _npz("oneclass"), "at least 2 classes"),
    ("npz-huge-label", _npz("hugelabel"), "field y"),
    ("npz-truncated", _npz("trunc"), "cannot read"),
    ("npz-not-zip", _npz("notzip"), "cannot read"),
    ("npz-pickled", _npz("pickled"), "cannot read"),
    ("folder-empty-class", lambda w: lb.load("folder", root=w / "emptyclass"), "dog holds no images"),
    ("folder-one-class", lambda w: lb.load("folder", root=w / "oneclass"), "at least 2 classes"),
    ("folder-size-huge", lambda w: lb.load("folder", root=w / "oneclass", size=100_000), "field size"),
    ("digits-size-100000", lambda w: lb.load("digits", size=100_000), "field size"),
    ("sphere-d-1e10", lambda w: lb.load("sphere", d=10**10), "field d"),
    ("mixture-n-1e10", lambda w: lb.load("gaussian-mixture", n=10**10), "field n"),
    ("dataset-nan", lambda w: lb.data.ImageDataset(torch.full((2, 1, 2, 2), float("nan")), [0, 1], ["a", "b"]),
     "field images"),
    ("dataset-one-class", lambda w: lb.data.ImageDataset(torch.zeros(2, 3), [0, 0], ["a"]), "field classes"),
    # observe()
    ("observe-nan-x", _observe(x=torch.full((2, 1, 8, 8), float("nan"))), "argument x"),
    ("observe-inf-x", _observe(x=torch.full((2, 1, 8, 8), float("inf"))), "argument x"),
    ("observe-empty-batch", _observe(x=torch.zeros(0, 1, 8, 8), y=torch.zeros(0, dtype=torch.long)), "empty batch"),
    ("observe-label-10", _observe(y=torch.tensor([3, 10])), "argument y"),
    ("observe-label-negative", _observe(y=torch.tensor([-1, 3])), "argument y"),
    ("observe-2d-int-labels", _observe(y=torch.zeros(2, 10, dtype=torch.long)), "argument y"),
    ("observe-2d-soft-wrong-width", _observe(y=torch.full((2, 3), 1 / 3)), "argument y"),
    ("observe-float-labels", _observe(y=torch.tensor([1.0, 2.0])), "argument y"),
    ("observe-nan-soft-targets", _observe(y=torch.full((2, 10), float("nan"))), "argument y"),
    ("observe-logistic-label-2", lambda w: lb.observe(lb.build("mlp:8", input_shape=(1, 8, 8), classes=1, seed=0),
                                                      _xy()[0], torch.tensor([0, 2]), loss="logistic"), "0..1"),
    ("observe-bool-labels", _observe(y=torch.tensor([True, False])), "argument y"),
    ("observe-uint8-x", _observe(x=torch.zeros(2, 1, 8, 8, dtype=torch.uint8)), "argument x"),
    ("observe-logistic-10-class", _observe(loss="logistic"), "argument loss"),
    ("observe-exponential-10-class", _observe(loss="exponential"), "argument loss"),
    ("observe-wrong-shape", _observe(x=torch.zeros(2, 1, 9, 9)), "argument x"),
    # specs
    ("spec-not-utf8", _spec_load("nonutf8"), "UTF-8"),
    ("spec-alias-bomb", _spec_load("bomb"), "alias bomb"),
    ("spec-recursive-alias", _spec_load("recursive"), "recursive"),
    ("spec-empty-grid", _spec_load("emptygrid"), "defenses[1]"),
    ("spec-exclude-typo", _spec_load("excludetypo"), "exclude[0].attack"),
    ("spec-include-typo", _spec_load("includetypo"), "include[0].defense"),
    ("spec-empty-rule", _spec_load("emptyrule"), "exclude[0]"),
    ("spec-bad-option-value", _spec_load("badoption"), "attacks[0].options.iterations"),
    ("spec-bad-option-type", _spec_load("badoptiontype"), "attacks[0].options.iterations"),
    ("preflight-images-100000", _preflight("huge"), "max_trials"),
    ("preflight-exclude-all", _preflight("excludeall"), "plans no trial"),
    ("preflight-act-relux", _preflight("relux"), "models[0]"),
    ("preflight-size-big", _preflight("sizebig"), "datasets[0]"),
    ("preflight-cnn-too-deep", _preflight("cnn99"), "models[0]"),
    ("preflight-missing-npz", _preflight("missingnpz"), "datasets[0]"),
    ("preflight-missing-folder", _preflight("missingfolder"), "datasets[0]"),
    ("preflight-logistic-10-class", _preflight("logistic"), "threat"),
    ("evaluate-act-relux", lambda w: lb.evaluate(lb.evaluation.load_spec(w / "relux.yaml"), w / "store.db"),
     "models[0]"),
    # stores
    ("store-foreign", _store("foreign.db"), "another program"),
    ("store-garbage", _store("garbage.db"), "not a readable"),
    ("store-truncated", _store("trunc.db"), "not a readable"),
    ("store-wrong-schema", _store("wrongschema.db"), "without column"),
    ("store-readonly-missing", _store("absent.db", readonly=True), "no such file"),
    ("store-readonly-empty", _store("empty.db", readonly=True), "no leakbench results"),
    ("store-other-spec", _other_spec_on_store, "another sweep"),
    # files are data
    ("target-pickle-payload", _pickle_target, "weights_only=True"),
]


@pytest.mark.parametrize("case, call, fragment", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input_is_a_value_error_naming_the_field(w, case, call, fragment):
    before = _store_rows(w / "store.db")
    with pytest.raises(ValueError) as info:
        call(w)
    message = str(info.value)
    assert isinstance(info.value, LeakbenchError), f"{case}: {type(info.value).__name__}: {message}"
    assert "\n" not in message and fragment in message, f"{case}: {message}"
    assert _store_rows(w / "store.db") == before
    assert not (w / "pwned").exists()


def test_float64_x_is_converted_to_the_model_dtype():
    x, y = _xy()
    model = _model()
    obs32 = lb.observe(model, x, y)
    obs64 = lb.observe(model, x.double(), y)  # converted, as a client's training loop would
    assert all(g.dtype == torch.float32 for g in obs64.shared)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(obs32.shared, obs64.shared))


def test_soft_and_signed_targets_still_pass():
    x, y = _xy()
    soft = lb.observe(_model(), x, torch.eye(10)[y])  # soft targets B×K, as DLG optimises them
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(soft.shared, lb.observe(_model(), x, y).shared))
    single = lb.build("mlp:8", input_shape=(1, 8, 8), classes=1, seed=0)
    signed = lb.observe(single, x, (2 * (y % 2) - 1).float(), loss="logistic")
    indices = lb.observe(single, x, y % 2, loss="logistic")
    assert all(torch.allclose(a, b) for a, b in zip(signed.shared, indices.shared))


def test_foreign_sqlite_file_gets_no_leakbench_tables(w):
    with pytest.raises(ConfigError):
        lb.evaluation.Store(w / "foreign.db")
    with sqlite3.connect(w / "foreign.db") as c:
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master")] == ["customers"]


def test_force_binds_a_store_to_a_new_spec(w, tmp_path):
    db = tmp_path / "s.db"
    shutil.copy(w / "copy.db", db)
    summary = lb.evaluate(lb.evaluation.load_spec(w / "other.yaml"), db, force=True)
    assert summary.counts == {"done": 3} and summary.ran == 3
    with lb.evaluation.Store(db) as store:
        assert store.counts() == {"done": 5}  # the first sweep's trials stay
    assert lb.evaluate(lb.evaluation.load_spec(w / "other.yaml"), db).ran == 0  # now bound to it


def test_report_reads_a_store_without_writing_it(w, tmp_path):
    from typer.testing import CliRunner

    from leakbench.cli import app

    db = tmp_path / "ro.db"
    shutil.copy(w / "copy.db", db)
    os.chmod(db, 0o444)
    stamp = (db.read_bytes(), db.stat().st_mtime_ns)
    result = CliRunner().invoke(app, ["report", str(db), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rep" / "index.html").is_file()
    assert (db.read_bytes(), db.stat().st_mtime_ns) == stamp
    assert not (tmp_path / "ro.db-wal").exists()
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        store = lb.evaluation.Store(db, readonly=True)
        try:
            store.set_meta("x", "1")
        finally:
            store.close()


def test_evaluate_exits_1_and_says_so_when_trials_failed(tmp_path):
    from typer.testing import CliRunner

    from leakbench.cli import app

    spec = _spec(tmp_path, "slow", {**GOOD, "attacks": [{"name": "inverting-gradients",
                                                         "options": {"iterations": 2000}}],
                                    "budget": {"trial_seconds": 0.001}})
    result = CliRunner().invoke(app, ["evaluate", str(spec), "--db", str(tmp_path / "r.db"), "-q"])
    assert result.exit_code == 1, result.output
    assert "2 of 2 trial(s) failed" in result.output and "--retry-failed" in result.output


def test_ctrl_c_prints_the_kept_trials_and_the_command_that_resumes(tmp_path):
    spec = _long_spec(tmp_path)
    db = tmp_path / "r.db"
    line = _interrupt_after_two_trials(["evaluate", str(spec), "--db", str(db), "-q"], db, tmp_path)
    kept = int(line.split(": ", 1)[1].split(" of ")[0])
    assert kept >= 2 and "of 8 trial(s) are kept" in line
    resume = line.split("resume with: ", 1)[1]
    assert resume == f"leakbench evaluate {spec} --db {db}"
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM trials WHERE status = 'done'").fetchone()[0] == kept
    done = subprocess.run([sys.executable, "-m", "leakbench.cli", *resume.split()[1:], "-q"], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*), max(attempts) FROM trials WHERE status = 'done'").fetchone() == (8, 1)


def test_dry_run_of_a_good_spec_says_valid_and_what_it_checked(w):
    from typer.testing import CliRunner

    from leakbench.cli import app

    result = CliRunner().invoke(app, ["evaluate", str(w / "good.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "valid; 2 trial(s) (2 attack); checked 1 dataset(s) (digits: 1797 × 1×8×8, 10 classes) and 1 model" \
        in " ".join(result.output.split())


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_is_refused_before_work(tmp_path):
    from leakbench.cli.common import check_out_dir

    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        with pytest.raises(ConfigError, match="cannot write into --out"):
            check_out_dir(locked, "--out")
    finally:
        os.chmod(locked, 0o755)


def test_ctrl_c_of_the_demo_prints_the_kept_trials_and_how_to_resume(tmp_path):
    spec = _long_spec(tmp_path)
    out_dir = tmp_path / "demo"
    line = _interrupt_after_two_trials(["demo", "--out", str(out_dir), "--spec", str(spec), "--workers", "1", "-q"],
                                       out_dir / "results.db", tmp_path)
    assert int(line.split(": ", 1)[1].split(" of ")[0]) >= 2 and "of 8 trial(s) are kept" in line
    assert line.split("resume with: ", 1)[1] == f"leakbench demo --out {out_dir} --spec {spec}"


def _long_spec(tmp_path: Path) -> Path:
    """A sweep of 8 trials of about 1.5 s each, so a SIGINT lands mid-sweep even when the polling lags behind
    (at 0.5 s a trial, a loaded machine let the sweep finish before the signal arrived)."""
    return _spec(tmp_path, "long", {**GOOD, "images": 8,
                                    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 120}}]})


def _interrupt_after_two_trials(args: list[str], db: Path, cwd: Path) -> str:
    """Run ``leakbench ARGS``, send SIGINT once two trials are done; its "interrupted: …" line (exit 130 asserted)."""
    proc = subprocess.Popen([sys.executable, "-m", "leakbench.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.2)
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as c:
                if c.execute("SELECT count(*) FROM trials WHERE status = 'done'").fetchone()[0] >= 2:
                    break
        except sqlite3.Error:
            continue
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err
    return next(line for line in err.splitlines() if line.startswith("interrupted"))
