"""What the robustness tests share: the work folder with a finished store and every bad file, the issue-29
files, small models and observations, and the driver that runs each untrusted case in a forked, memory-capped,
deadline-bound child."""
from __future__ import annotations

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
import torch
import yaml

import leakbench as lb
from leakbench.errors import ConfigError

GOOD = {"name": "robust", "datasets": [{"name": "digits"}], "models": [{"spec": "mlp:8", "act": "relu"}],
        "batch_sizes": [1], "images": 2, "attacks": [{"name": "fc-inversion"}]}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"),
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



def make_work(w: Path) -> Path:
    """A work folder with a finished results store and every bad file the tables refer to."""
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




def _argv(template: str, w: Path) -> list[str]:
    return [part.replace("{w}", str(w)) for part in template.split()]


def _assert_one_line(code, stdout: str, stderr: str, fragment: str, case: str) -> None:
    assert "Traceback" not in stdout + stderr, f"{case}: {stderr}"
    assert code == 2, f"{case}: exit {code}\n{stdout}\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {stderr}"
    assert fragment in lines[0], f"{case}: {fragment!r} not in {lines[0]!r}"




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




def _long_spec(tmp_path: Path) -> Path:
    """A sweep of 8 trials of about 1.5 s each, so a SIGINT lands mid-sweep even when the polling lags behind
    (at 0.5 s a trial, a loaded machine let the sweep finish before the signal arrived).  DLG's L-BFGS runs
    each trial alone: Adam-based attacks of one shape would be solved together in one stacked call and
    finish at the same instant."""
    return _spec(tmp_path, "long", {**GOOD, "images": 8,
                                    "attacks": [{"name": "dlg", "options": {"iterations": 200}}]})


def default_sigint() -> None:
    """In the child before exec: Ctrl-C as a user's terminal delivers it.  A test run started as a background job
    (``pytest ... &``) ignores SIGINT, and an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_after_two_trials(args: list[str], db: Path, cwd: Path) -> str:
    """Run ``leakbench ARGS``, send SIGINT once two trials are done; its "interrupted: …" line (exit 130 asserted)."""
    proc = subprocess.Popen([sys.executable, "-m", "leakbench.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd, preexec_fn=default_sigint)
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



def make_untrusted(w: Path) -> Path:
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



def _deep(spec: dict, depth: int) -> dict:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return {**spec, "description": value}


def _preflight_u(u: Path, name: str):
    from leakbench.evaluation.running.preflight import preflight

    return preflight(lb.evaluation.load_spec(u / f"{name}.yaml"))


def _capped(u: Path) -> None:
    # the cap is decided when the sweep is built (no pool started here: a capped pool running its trials is
    # tests/evaluation/running/test_processes.py's kill-and-resume test, 2 workers)
    sweep = lb.evaluation.Sweep(GOOD, u / "capped.db", workers=10_000)
    try:
        assert sweep.workers <= min(os.cpu_count() or 1, len(sweep.trials)), sweep.workers
        assert any("capped" in n for n in sweep.notes), sweep.notes
    finally:
        sweep.store.close()


FORK_DRIVER = r"""
import contextlib, io, json, os, resource, select, sys, time, traceback
mode, limit, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
import sklearn.datasets  # noqa: F401  (each case is a child forked from here: scikit-learn's loaders, which most
                         # cases reach through the digits, are imported once here instead of ~1.5 s in every child)
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


