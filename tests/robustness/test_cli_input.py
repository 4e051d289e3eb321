"""Bad input through the command line: one ``error:`` line naming the field, exit 2, no traceback, the
store unchanged (issue 14; the table runs in one separate process)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _robust import (  # noqa: E402
    ENV,
    GOOD,
    _argv,
    _assert_one_line,
    _spec,
    _store_rows,
)


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
