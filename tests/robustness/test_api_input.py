"""Bad input through the Python API: a ``ValueError`` subclass with one line naming the field (issue 14), and
what a whole run keeps when it is refused, interrupted or fails."""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, LeakbenchError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _robust import (  # noqa: E402
    ENV,
    GOOD,
    _interrupt_after_two_trials,
    _long_spec,
    _model,
    _observe,
    _spec,
    _store_rows,
    _xy,
)


# --------------------------------------------------------------------------- the API table
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


@pytest.mark.slow  # a sweep interrupted and resumed in subprocesses; the demo's Ctrl-C test stays fast
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


@pytest.mark.slow  # the demo's CLI in a subprocess, ~15 s: `make test-slow` (tests/cli/test_interrupt.py and the kill -9 resume in test_processes.py stay)
def test_ctrl_c_of_the_demo_prints_the_kept_trials_and_how_to_resume(tmp_path):
    spec = _long_spec(tmp_path)
    out_dir = tmp_path / "demo"
    line = _interrupt_after_two_trials(["demo", "--out", str(out_dir), "--spec", str(spec), "--workers", "1", "-q"],
                                       out_dir / "results.db", tmp_path)
    assert int(line.split(": ", 1)[1].split(" of ")[0]) >= 2 and "of 8 trial(s) are kept" in line
    assert line.split("resume with: ", 1)[1] == f"leakbench demo --out {out_dir} --spec {spec}"
