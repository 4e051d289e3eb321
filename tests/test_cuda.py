"""The CUDA paths: batched attacks, batched training seeds, chunks and a sweep on a GPU (skipped without one).

Run where a GPU is: ``pytest tests/test_cuda.py``.  float64 throughout, as in the CPU equality tests: stacked
problems give each problem what it gets alone (here within 1e-6: cuDNN picks its algorithm per shape, so a stack
and a single problem round differently), and a GPU result agrees with the CPU one.
"""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.attacks import attack_batch
from leakbench.evaluation import Store, Sweep, load_spec, plan
from leakbench.evaluation.running import chunks
from leakbench.evaluation.running.chunks import CUDA_CHUNK, batch_group, cuda_stack, run_chunk, stack_size
from leakbench.evaluation.running.run import run_trial
from leakbench.evaluation.training.utility import utility_seeds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
DATA = lb.load("digits")
SPEC = {
    "name": "cuda",
    "datasets": [{"name": "digits"}],
    "models": [{"spec": "cnn:3-4-2-1", "act": "tanh"}],
    "batch_sizes": [1],
    "images": 4,
    "attacks": [{"name": "inverting-gradients", "options": {"iterations": 8}}],
    "defenses": ["none", "noise:0.01"],
    "device": "cuda",
}


@pytest.fixture(autouse=True)
def _deterministic():
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = saved


def _observations(count: int, batch: int, device: torch.device) -> list:
    model = lb.build("cnn:3-4-2-1", input_shape=DATA.shape, classes=10, act="tanh", seed=0).double().to(device)
    out = []
    for t in range(count):
        x, y = DATA.batch(size=batch, seed=100 + t)
        out.append(lb.observe(model, x.double().to(device), y.to(device), defense="noise:0.001" if t % 2 else "none",
                              seed=t))
    return out


@pytest.mark.parametrize("name, options", [
    ("inverting-gradients", {"preset": "quick", "iterations": 12}),
    ("inverting-gradients", {"preset": "fast", "iterations": 10}),  # with the output-layer feature term
    ("dlg", {"iterations": 10, "optimizer": "adam", "lr": 0.05}),
    ("liu2024", {"generator": False, "feature": 0.0, "iterations": 10}),
])
def test_a_stack_on_the_gpu_equals_each_problem_alone_and_the_cpu(name, options):
    observations = _observations(3, 2, CUDA)
    seeds = [3 * i + 1 for i in range(len(observations))]
    stacked = attack_batch(name, observations, seeds=seeds, **options)
    on_cpu = attack_batch(name, _observations(3, 2, torch.device("cpu")), seeds=seeds, **options)
    for obs, seed, rec, cpu in zip(observations, seeds, stacked, on_cpu):
        assert not isinstance(rec, Exception), rec
        assert rec.images.device.type == "cuda"
        assert rec.trace["stacked"] == 3 or options.get("preset") == "fast", "fast stacks per label count"
        alone = lb.attack(name, obs, seed=seed, **options)
        assert torch.allclose(rec.images, alone.images, atol=1e-6, rtol=0)
        assert torch.allclose(rec.images.cpu(), cpu.images, atol=1e-6, rtol=0)
        assert torch.equal(rec.labels.reshape(-1).cpu(), alone.labels.reshape(-1).cpu())


@pytest.mark.parametrize("defense", ["none", "dpsgd:1,0.5"])
def test_training_seeds_stacked_on_the_gpu_equal_each_seed_alone(defense):
    common = dict(epochs=1, batch_size=16, lr=0.05, cache_dir=False, device="cuda", model_options={"act": "tanh"})
    stacked = utility_seeds("cnn:3-4-2-1", "digits", defense, seeds=[0, 1, 2], **common)  # stacks by default
    alone = utility_seeds("cnn:3-4-2-1", "digits", defense, seeds=[0, 1, 2], stacked=False, **common)
    for a, b in zip(stacked, alone):
        assert not isinstance(a, Exception), a
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-4, abs=1e-5)
        assert a.test_accuracy == pytest.approx(b.test_accuracy, abs=1e-6)
    assert len({r.train_loss for r in stacked}) == 3, "three seeds, three runs"


def test_cuda_chunks_are_large_and_sized_by_memory():
    trials = plan(load_spec(SPEC))
    assert stack_size(trials[0]) == CUDA_CHUNK
    obs = chunks.observation_for(trials[0], None)
    assert obs.device.type == "cuda"
    assert 1 <= cuda_stack(obs, CUDA) <= CUDA_CHUNK


def test_a_chunk_on_the_gpu_equals_each_trial_alone():
    trials = [t for t in plan(load_spec(SPEC)) if t.defense == "none"]
    assert len({batch_group(t) for t in trials}) == 1
    for trial, result in zip(trials, run_chunk(trials)):
        alone = run_trial(trial)
        assert result.status == alone.status == "done", result.error
        assert result.timings["stacked"] == len(trials)
        assert result.metrics["rmse"] == pytest.approx(alone.metrics["rmse"], rel=1e-3, abs=1e-5)


def test_a_stack_that_runs_out_of_gpu_memory_is_halved(monkeypatch):
    trials = [t for t in plan(load_spec(SPEC)) if t.defense == "none"]
    sizes: list[int] = []
    real = attack_batch

    def small_gpu(name, observations, **kw):  # a GPU that holds two problems at a time
        sizes.append(len(observations))
        if len(observations) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(name, observations, **kw)

    monkeypatch.setattr("leakbench.attacks.attack_batch", small_gpu)
    results = list(run_chunk(trials))
    assert [r.status for r in results] == ["done"] * len(trials)
    assert sizes[0] == len(trials) and max(sizes[1:]) <= 2


def test_a_sweep_on_the_gpu_commits_every_trial_and_resumes(tmp_path):
    spec = {**SPEC, "utility": {"epochs": 1, "batch_size": 16, "lr": 0.05, "seeds": [0, 1]}}
    first = Sweep(spec, tmp_path / "r.db", max_trials=5).run()
    assert first.ran == 5
    rest = Sweep(spec, tmp_path / "r.db").run()
    rows = Store(tmp_path / "r.db").rows()
    assert first.ran + rest.ran == len(rows) == len(plan(load_spec(spec)))
    assert {r["status"] for r in rows} == {"done"}
    on_cpu = {t.key: t for t in plan(load_spec({**spec, "device": "cpu"}))}
    assert set(on_cpu) == {r["key"] for r in rows}, "the device is no part of a trial's key"


def test_spear_on_the_gpu_certifies_the_batch_the_cpu_certifies():
    """SPEAR's peeling, factorisation and certificates on CUDA tensors: the same certified, exact samples."""
    data = lb.load("digits", size=28)
    x, y = data.batch(32, seed=11)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0)
    on_cpu = lb.attack("spear", lb.observe(model, x, y))
    on_gpu = lb.attack("spear", lb.observe(model.to(CUDA), x.to(CUDA), y.to(CUDA)))
    assert on_gpu.images.device.type == "cuda"
    assert int(on_gpu.confidence.sum()) == int(on_cpu.confidence.sum()) >= 30
    scores = lb.compare(on_gpu.images.cpu(), x, y)
    assert sum(p > 60 for p in scores["per_sample"]["psnr"]) >= 30


def test_dager_and_tag_on_the_gpu():
    """DAGER's span checks and greedy extension on CUDA: exact, flagged; TAG runs there and returns ids."""
    from leakbench.metrics.text_metrics import text_scores

    data = lb.load("text", split="test", context=16)
    model = lb.build("gpt:layers=2,width=128,heads=4", input_shape=data.shape, classes=data.vocab_size,
                     seed=0).to(CUDA)
    x, y = data.batch(4, seed=4)
    obs = lb.observe(model, x.to(CUDA), y.to(CUDA))
    rec = lb.attack("dager", obs)
    assert rec.images.device.type == "cuda" and rec.trace["exact"] == [True] * 4
    s = text_scores(rec.images.cpu(), x, decode=data.tokenizer.decode, pad_id=data.pad_id,
                    eos_id=data.tokenizer.eos_id)
    assert s["token_acc"] == 1.0
    tag = lb.attack("tag", obs, iterations=5)
    assert tag.images.device.type == "cuda" and tag.images.shape == x.shape


def test_dager_encoder_search_on_the_gpu():
    """DAGER's encoder search (B > 1) on CUDA: the same sequences and flags as on the CPU."""
    data = lb.load("text", split="test", context=16).with_task("classify")
    model = lb.build(f"bert:layers=2,width=128,heads=4,vocab={data.vocab_size}", input_shape=data.shape,
                     classes=data.num_classes, seed=0)
    x, y = data.batch(4, seed=100)
    on_cpu = lb.attack("dager", lb.observe(model, x, y))
    model = model.to(CUDA)
    on_gpu = lb.attack("dager", lb.observe(model, x.to(CUDA), y.to(CUDA)))
    assert on_gpu.images.device.type == "cuda" and on_gpu.trace["exact"] == on_cpu.trace["exact"] == [True] * 4
    assert {tuple(r) for r in on_gpu.images.cpu().tolist()} == {tuple(r) for r in x.tolist()}


def test_spear_at_large_batch_on_the_gpu_certifies_the_whole_batch():
    """B = 128 on ``mlp:1000``: the next layer's directions, the zero band, the hinge polish and the joint
    certificate on CUDA tensors (the large-B path; B = 32 above never reaches it)."""
    data = lb.load("digits", size=28, deform=1.0, seed=1)
    x, y = data.batch(128, seed=5)
    model = lb.build("mlp:1000", input_shape=data.shape, classes=10, seed=0).to(CUDA)
    rec = lb.attack("spear", lb.observe(model, x.to(CUDA), y.to(CUDA)))
    assert rec.images.device.type == "cuda"
    order = torch.tensor(lb.compare(rec.images.cpu(), x)["order"])
    err = (rec.images.cpu().double()[order] - x.double()).reshape(128, -1).abs().amax(1)
    certified = rec.confidence.cpu().bool()[order]
    assert int(certified.sum()) >= 120, rec.trace.get("uncertified")
    assert float(err[certified].max()) < 1e-4, "no certificate is wrong on the GPU either"


def test_spear_features_on_the_gpu_recovers_a_convnets_features_and_images():
    from torch import nn

    data = lb.load("digits")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 1000), nn.ReLU(),
                        nn.Linear(1000, 10)).to(CUDA)
    x, y = data.batch(32, seed=3)
    rec = lb.attack("spear-features", lb.observe(net, x.to(CUDA), y.to(CUDA)))
    assert rec.images.device.type == "cuda" and int(rec.confidence.sum()) == 32
    order = torch.tensor(lb.compare(rec.images.cpu(), x)["order"])
    assert float((rec.images.cpu().double()[order] - x.double()).abs().amax()) < 1e-4


@pytest.mark.parametrize("name, options", [
    ("gias", {"latent_steps": 6, "generator_steps": 3}),
    ("gifd", {"latent_steps": 6, "feature_steps": 3}),
    ("ggl", {"evaluations": 30}),
])
def test_the_generative_attacks_run_on_the_gpu(name, options, tmp_path):
    """The learned prior is trained (or read from its cache) and searched on the observation's device."""
    from leakbench.models.prior import PriorConfig

    tiny = PriorConfig(latent=4, width=4, steps=20, batch=16, seed=0)
    prior = {"latent": tiny.latent, "prior_width": tiny.width, "prior_steps": tiny.steps, "cache_dir": str(tmp_path)}
    data = lb.load("digits", size=8)
    model = lb.build("cnn:4-3-1-1", input_shape=data.shape, classes=10, act="sigmoid", seed=0).to(CUDA)
    x, y = data.batch(indices=list(range(1000, 1002)))
    obs = lb.observe(model, x.to(CUDA), y.to(CUDA))
    rec = lb.attack(name, obs, preset="quick", seed=0, **prior, **options)
    assert rec.images.device.type == "cuda" and rec.images.shape == x.shape
    assert bool(torch.isfinite(rec.images).all())


def test_a_federated_sweep_on_the_gpu_trains_its_rounds_and_resumes(tmp_path):
    """The training axis on CUDA: the FedAvg run, its checkpoints, the client and public-data trials, the store."""
    spec = {"name": "fed-cuda", "datasets": [{"name": "digits", "options": {"limit": 240}}],
            "models": [{"spec": "mlp:16", "federated": {"clients": 3, "rounds": [0, 2], "public": 8, "lr": 0.1}}],
            "batch_sizes": [2], "images": 4, "seeds": [0],
            "attacks": [{"name": "inverting-gradients", "options": {"iterations": 4}, "label": "ig"}],
            "defenses": ["none", "noise:0.1"], "device": "cuda"}
    first = Sweep(spec, tmp_path / "r.db", max_trials=7).run()
    assert first.ran == 7
    rest = Sweep(spec, tmp_path / "r.db").run()
    rows = Store(tmp_path / "r.db").rows()
    assert first.ran + rest.ran == len(rows) == len(plan(load_spec(spec)))
    assert {r["status"] for r in rows} == {"done"}, [r.get("error") for r in rows if r["status"] != "done"]
    assert any((r.get("spec") or {}).get("client") == "public" for r in rows if r["kind"] == "attack")
