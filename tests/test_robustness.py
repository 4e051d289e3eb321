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
from typing import Any

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
     "model with 1 output"),
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
     "model with 1 output"),
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
        from leakbench.evaluation.running.preflight import preflight

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


def _observe_one_class(data):
    """One class loads; a one-output model's cross-entropy gradient (exactly 0) is what is refused."""
    model = lb.build("mlp:8", input_shape=data.shape, classes=data.num_classes, seed=0)
    x, y = data.batch(2, seed=0)
    return lb.observe(model, x, y)


API_CASES = [
    # data
    ("npz-nan", _npz("nan"), "NaN/inf"),
    ("npz-inf", _npz("inf"), "NaN/inf"),
    ("npz-one-class", lambda w: _observe_one_class(_npz("oneclass")(w)), "model with 1 output"),
    ("npz-huge-label", _npz("hugelabel"), "field y"),
    ("npz-truncated", _npz("trunc"), "cannot read"),
    ("npz-not-zip", _npz("notzip"), "cannot read"),
    ("npz-pickled", _npz("pickled"), "cannot read"),
    ("folder-empty-class", lambda w: lb.load("folder", root=w / "emptyclass"), "dog holds no images"),
    ("folder-one-class", lambda w: _observe_one_class(lb.load("folder", root=w / "oneclass")), "model with 1 output"),
    ("folder-size-huge", lambda w: lb.load("folder", root=w / "oneclass", size=100_000), "field size"),
    ("digits-size-100000", lambda w: lb.load("digits", size=100_000), "field size"),
    ("sphere-d-1e10", lambda w: lb.load("sphere", d=10**10), "field d"),
    ("mixture-n-1e10", lambda w: lb.load("gaussian-mixture", n=10**10), "field n"),
    ("dataset-nan", lambda w: lb.data.ImageDataset(torch.full((2, 1, 2, 2), float("nan")), [0, 1], ["a", "b"]),
     "field images"),
    ("dataset-no-class", lambda w: lb.data.ImageDataset(torch.zeros(2, 3), [0, 0], []), "field classes"),
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
    # nothing was measured: said so (no verdict), with the command that runs the timed-out trials again
    assert "no trial succeeded (2 timed out)" in result.output and "--retry-failed" in result.output


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
    (at 0.5 s a trial, a loaded machine let the sweep finish before the signal arrived).  DLG's L-BFGS runs
    each trial alone: Adam-based attacks of one shape would be solved together in one stacked call and
    finish at the same instant."""
    return _spec(tmp_path, "long", {**GOOD, "images": 8,
                                    "attacks": [{"name": "dlg", "options": {"iterations": 200}}]})


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


# =========================================================================== issue 29: trust nothing
# Files, clients and specs that lie about their size, layout or values.  Every case runs in a process of
# its own (forked from a driver that imported leakbench once) under RLIMIT_AS (3 GiB: a file that makes
# leakbench allocate its declared gigabytes fails) and is killed at its deadline (a FIFO or an unbounded
# loop fails instead of hanging); the driver runs in its own session, so no process a case started can
# outlive it unseen.  Case ids start with their class (the list):
#   retry · paths · finite · shapes · formats · work · flower · terminal · traceback
# API cases: a ValueError subclass (LeakbenchError) with one line holding the fragment, or ``None``: the call
# must succeed.  CLI cases: exit 2 and one ``error:`` line holding the fragment, the store unchanged.

LIMIT_AS = 3 * 1024**3
CASE_SECONDS = 45


def _npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                "shape": shape})
    return buf.getvalue()


def _declared_npz(path: Path, members: dict[str, tuple[tuple[int, ...], str] | np.ndarray]) -> None:
    """An npz whose members are real arrays or only a header declaring ``shape`` (the body left out)."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, value in members.items():
            if isinstance(value, np.ndarray):
                buf = io.BytesIO()
                np.lib.format.write_array(buf, value, allow_pickle=False)
                z.writestr(f"{name}.npy", buf.getvalue())
            else:
                z.writestr(f"{name}.npy", _npy_header(*value) + bytes(4096))


def _gz_bomb(path: Path, shape: tuple[int, ...], total: int) -> None:
    """A gzipped IDX file declaring ``shape`` whose body inflates to ``total`` zero bytes (a few MB on disk)."""
    import gzip

    header = bytes([0, 0, 0x08, len(shape)]) + b"".join(int(s).to_bytes(4, "big") for s in shape)
    chunk = gzip.compress(bytes(64 * 1024**2), compresslevel=1)
    with open(path, "wb") as f:
        f.write(gzip.compress(header))
        for _ in range(total // (64 * 1024**2)):
            f.write(chunk)


def _images(root: Path, make) -> Path:
    """A class folder ``root`` with one good PNG class and one class holding ``make(path_stem)``'s file."""
    from PIL import Image

    (root / "good").mkdir(parents=True, exist_ok=True)
    (root / "bad").mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), 90).save(root / "good" / "0.png")
    make(root / "bad" / "0")
    return root


def _cifar(root: Path, data: np.ndarray, labels: list[int]) -> Path:
    import pickle

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f, protocol=2)
    return root


class _Tuple(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(x.flatten(1)), x


@pytest.fixture(scope="module")
def u(w) -> Path:
    """The files of the issue-29 cases, in the robustness work folder."""
    from PIL import Image

    root = w / "u"
    root.mkdir()
    x = np.random.default_rng(0).random((4, 8, 8)).astype(np.float32)
    np.savez(root / "ambiguous.npz", x=np.random.default_rng(0).random((4, 3, 4, 4)).astype(np.float32),
             y=np.arange(4) % 2)  # 4×4 RGB (NCHW) or 3×4 RGBA (NHWC)?
    _declared_npz(root / "bomb.npz", {"x": ((100_000, 3, 64, 64), "<f4"), "y": np.arange(4) % 2})
    _declared_npz(root / "unused.npz", {"x": x, "y": np.arange(4) % 2, "junk": ((50_000, 3, 256, 256), "<f4")})
    mnist = root / "mnist"
    mnist.mkdir()
    _gz_bomb(mnist / "train-images-idx3-ubyte.gz", (60_000, 280, 280), 3 * 1024**3 + 64 * 1024**2)
    import gzip

    (mnist / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes([0, 0, 8, 1]) + (60_000).to_bytes(4, "big")
                                                                     + bytes(60_000)))
    short = root / "mnist-short"
    short.mkdir()
    (short / "train-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big")
                                                                                  for n in (10, 28, 28)) + bytes(99))
    (short / "train-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + (10).to_bytes(4, "big") + bytes(10))
    _cifar(root / "cifar-shape", np.zeros((10, 100), np.uint8), [0] * 10)
    _cifar(root / "cifar-labels", np.zeros((10, 3072), np.uint8), [99] * 10)
    _cifar(root / "cifar-object", np.array(["not", "pixels"], dtype=object), [0, 1])
    _images(root / "gif", lambda p: Image.new("L", (8, 8), 10).save(
        p.with_suffix(".gif"), save_all=True, append_images=[Image.new("L", (8, 8), 200)], duration=50, loop=0))
    _images(root / "tiffstack", lambda p: Image.new("L", (8, 8), 10).save(
        p.with_suffix(".tif"), save_all=True, append_images=[Image.new("L", (8, 8), 200)]))
    _images(root / "cmyk", lambda p: Image.new("CMYK", (8, 8), (0, 255, 0, 0)).save(p.with_suffix(".jpg")))
    _images(root / "lab", lambda p: Image.new("LAB", (8, 8), (50, 0, 0)).save(p.with_suffix(".tif")))
    _images(root / "fifo", lambda p: os.mkfifo(p.with_suffix(".png")))
    _images(root / "bigpng", lambda p: Image.new("L", (10_000, 10_000), 0).save(p.with_suffix(".png")))
    model = _model()
    torch.save({k: v.to_sparse() if v.dim() == 2 else v for k, v in model.state_dict().items()}, root / "sparse.pt")
    torch.save({k: torch.zeros(1).expand(v.shape) if v.dim() == 2 else v for k, v in model.state_dict().items()},
               root / "expanded.pt")
    torch.save({"w": torch.zeros(1).expand(10**6, 10**6)}, root / "tera.pt")
    torch.save({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, root / "zeros.pt")
    from leakbench.models.files import save_model

    save_model(model, root / "model.pt")
    meta = torch.load(root / "model.pt", weights_only=True)
    torch.save({**meta, "spec": "mlp:100000000"}, root / "hugemeta.pt")
    torch.save({**meta, "input_shape": [1, 10**9, 10**9]}, root / "hugeshape.pt")
    specs = {
        "seed-2-63": {**GOOD, "seeds": [2**63]},
        "threads-2-40": {**GOOD, "threads": 2**40},
        "iterations-1e12": {**GOOD, "attacks": [{"name": "inverting-gradients", "options": {"iterations": 10**12}}]},
        "restarts-1e9": {**GOOD, "attacks": [{"name": "dlg", "options": {"restarts": 10**9}}]},
        "steps-product": {**GOOD, "attacks": [{"name": "inverting-gradients",
                                              "options": {"iterations": 10**6, "restarts": 10**4}}]},
        "epochs-1e9": {**GOOD, "models": [{"spec": "mlp:8", "act": "relu", "training": {"epochs": 10**9}}]},
        "utility-epochs-1e9": {**GOOD, "utility": {"epochs": 10**9}},
        "label-markup": {**GOOD, "name": "[link=http://evil.example]x[/link]\x1b[2J[/x]",
                         "attacks": [{"name": "fc-inversion", "label": "[/x]\x1b]8;;http://e\x07y"}]},
    }
    for name, text in specs.items():
        _spec(root, name, text)
    _spec(root, "nested", "a: " + "[" * 5000 + "]" * 5000 + "\n")
    return root


def _meta_model():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))


def _nan_model():
    model = _model()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    return model


def _zero_observation():
    model = _model()
    return lb.Observation.from_gradients(model, [torch.zeros_like(p) for p in model.parameters()], batch_size=1)


def _observation(change):
    def run(u):
        model = _model()
        obs = lb.observe(model, *_xy())
        fields = {"kind": obs.kind, "model": obs.model, "shared": obs.shared, "param_names": obs.param_names,
                  "loss": obs.loss, "batch_size": obs.batch_size, "input_shape": obs.input_shape,
                  "num_classes": obs.num_classes, **change(obs)}
        return lb.Observation(**fields)
    return run


def _grads_1e300(u):
    model = _model()
    grads = [torch.full(p.shape, 1e300, dtype=torch.float64) for p in model.parameters()]
    return lb.Observation.from_gradients(model, grads, batch_size=1)


def _training(**metrics):
    from leakbench.integrations.flower.keys import local_training

    return lambda u: local_training({"lr": 0.1}, {"num-examples": 1, **metrics})


def _wrong_batch(u):
    from leakbench.integrations.flower.audit import Auditor
    from leakbench.integrations.flower.keys import LocalTraining

    before, after = _model(), _model()
    data = lb.load("digits")
    x, y = data.images[:1], data.labels[:1]
    loss = torch.nn.functional.cross_entropy(after(x), y)  # the client's honest step on sample 0
    for p, g in zip(after.parameters(), torch.autograd.grad(loss, list(after.parameters()))):
        p.data -= 0.1 * g
    auditor = Auditor(["fc-inversion"])
    training = LocalTraining(batch_size=1, lr=0.1)
    assert auditor.verify(before, after, training, x, y) is None  # its own batch fits
    reason = auditor.verify(before, after, training, data.images[5:6], data.labels[5:6])  # another client's
    raise ConfigError(f"unverified: {reason}")


def _files(function: str, name: str):
    def run(u):
        from leakbench.models import files

        call = getattr(files, function)
        return call(_model(), u / name) if function == "load_weights" else call(u / name)
    return run


def _outside_commit(u):
    from leakbench.evaluation.trials.trial import TrialResult

    db = u / "commit.db"
    with lb.evaluation.Store(db) as store:
        store.commit(TrialResult(key="k", status="done"), {"npz": u.parents[1] / "elsewhere.npz"})


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


def _deep(spec: dict, depth: int) -> dict:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return {**spec, "description": value}


def _preflight_u(u: Path, name: str):
    from leakbench.evaluation.running.preflight import preflight

    return preflight(lb.evaluation.load_spec(u / f"{name}.yaml"))


def _capped(u: Path) -> None:
    sweep = lb.evaluation.Sweep(GOOD, u / "capped.db", workers=10_000)
    try:
        assert sweep.workers <= min(os.cpu_count() or 1, len(sweep.trials)), sweep.workers
        assert any("capped" in n for n in sweep.notes), sweep.notes
        assert sweep.run().counts == {"done": 2}
    finally:
        sweep.store.close()


FORK_DRIVER = r"""
import contextlib, io, json, os, resource, select, sys, time, traceback
mode, limit, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if mode == "api":  # the case table of the test module, called with the issue-29 folder
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("robustness_cases", sys.argv[4])
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    from leakbench.errors import LeakbenchError
    table, folder = {c[1]: c[2] for c in cases.UNTRUSTED_API}, Path(sys.argv[5])

    def case(name):
        try:
            table[name](folder)
            return {"ok": True}
        except BaseException as err:
            return {"ok": False, "type": type(err).__name__, "message": str(err)[:3000],
                    "leakbench": isinstance(err, LeakbenchError), "value_error": isinstance(err, ValueError),
                    "traceback": traceback.format_exc()[-3000:]}
else:  # argv lists for the leakbench command
    from leakbench.cli import app

    def case(argv):
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
        return {"code": code, "stdout": so.getvalue(), "stderr": se.getvalue()}

out = []
for item in json.loads(sys.stdin.read()):  # each case in a forked child: its own RLIMIT_AS, killed at the deadline
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            data = json.dumps(case(item)).encode()
        except BaseException as err:
            data = json.dumps({"ok": False, "code": "driver", "type": type(err).__name__, "message": str(err),
                               "stdout": "", "stderr": traceback.format_exc()}).encode()
        with os.fdopen(write, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(write)
    chunks, deadline, done = [], time.monotonic() + seconds, False
    while not done and time.monotonic() < deadline:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            chunk = os.read(read, 1 << 16)
            chunks.append(chunk)
            done = not chunk
    os.close(read)
    if not done:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    try:
        result = json.loads(b"".join(chunks)) if done else None
    except ValueError:
        result = None
    if result is None:
        why = f"ran past {seconds:g} s" if not done else f"died (wait status {status})"
        result = {"ok": False, "code": why, "type": "Bounded", "message": why, "leakbench": False,
                  "value_error": False, "traceback": why, "stdout": "", "stderr": why}
    out.append(result)
print(json.dumps(out))
"""


def _session_alive(sid: int) -> list[str]:
    """Processes still running in session ``sid`` (what a case started and left behind)."""
    ps = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.split()[1:2] == [str(sid)]]


def _bounded(args: list[str], payload: str, cwd: Path, timeout: float = 900) -> tuple[subprocess.CompletedProcess,
                                                                                     list[str]]:
    """Run a driver in its own session; (the result, processes of that session left behind)."""
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(payload, timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = []
    for _ in range(50):  # a worker exits within a second of its parent; give it that long, no more
        left = _session_alive(proc.pid)
        if not left:
            break
        time.sleep(0.1)
    return subprocess.CompletedProcess(args, proc.returncode, out, err), left


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


@pytest.mark.parametrize("entry", ["module", "script"])
def test_untrusted_traceback_ctrl_c_during_start_up_exits_130(w, entry):
    script = Path(sys.executable).parent / "leakbench"
    if entry == "script" and not script.is_file():
        pytest.skip("no leakbench console script beside this Python")
    argv = [sys.executable, "-m", "leakbench.cli"] if entry == "module" else [str(script)]
    proc = subprocess.Popen([*argv, "evaluate", str(w / "good.yaml"), "--dry-run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=w)
    time.sleep(0.3)  # still importing torch (seconds): the signal lands before any command runs
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out + err, err
    assert [line for line in err.splitlines() if line.strip()] == ["interrupted"]


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
