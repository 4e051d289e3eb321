"""The malicious server, from both sides: what it recovers, and whether the client's check catches it.

1. **Trap weights** (Boenisch et al., EuroS&P 2023): ``mlp:1000`` (ReLU) whose first layer the server replaces by
   trap rows calibrated on 256 public images (the last ones of the dataset; the attacked batches never hold
   one), B = 64, on digits and on the CIFAR-10 test images (../shared/data/cifar10-test-1000.npz).  Settings: the
   plain gradient (FedSGD); secure aggregation of 4 clients (``secagg:4``: the other 3 batches drawn from the
   same pool, rows calibrated to fire for 1/(4·64)); FedAvg local epochs (``local:E,0.05,16``: E epochs of
   4 minibatches of 16).  Per sample of the *target* client: exact = its matched reconstruction within 10⁻³ of
   every pixel (a quarter of an 8-bit level), after the best one-to-one matching (Hungarian on MSE,
   confident-first); Wilson 95 % interval over the n = B·batches samples; flagged = slots the attack proves
   alone; wrong flags = flagged slots that are no sample (must be 0).  Beside them, chance: a grey image at the
   dataset mean, and random members of the dataset (as many slots as the attack returns, matched the same way).
   "one s" is the paper's single scale factor (tuned on the public images), "per-row s" our calibration.
2. **Class fishing** (Wen et al., ICML 2022) read from the honest first layer: the target class's samples.
3. **The client's check** (``lb.inspect``) on the library's own malicious models — trap weights (first layer and
   block), imprint block, random head, class and feature fishing (and a later round of ``fishing-rounds``: another
   feature, threshold and sharpness), LOKI (the model one client receives), over architectures, seeds and options, in a first round
   (no model held before) and in a later round (the honest model held before) — and on honest models: fresh
   initialisations of every family and init, checkpoints of SGD runs (digits, CIFAR-10) and of FedAvg runs
   (:mod:`leakbench.evaluation.training.federated`), each inspected against the previous checkpoint, always with the
   client's batch of 64.  Detection and false-positive rates with Clopper–Pearson 95 % intervals.
4. **LOKI** (Zhao et al., S&P 2024): each of the 4 secure-aggregation clients trains its own customised model
   (identity kernels into its own channels, an imprint layer over all of them); the target client's samples and
   all 4 clients' from the secure sum, beside one imprint block shared by all (Robbing the Fed) and chance.
5. **The adaptive server**: trap rows whose negatives are a Bernoulli(½) draw per entry (no exact half): which
   checks still fire.

``--quick``: one batch per cell, fewer models.
"""
from __future__ import annotations

import copy
import time

import torch
from scipy.stats import binomtest

import leakbench as lb
from leakbench.analysis.inspection import inspect
from leakbench.evaluation.training.federated import Run
from leakbench.evaluation.sweep_spec.federated import FederatedEntry
from leakbench.metrics import match
from leakbench.defenses.pipeline import other_batches
from leakbench.models.active import fishing, refished, trap_rows, trap_scales, trap_weights
from leakbench.models.loki import loki as loki_model
from leakbench.models.malicious import imprint, random_head

from .common import CIFAR_NPZ, table

B = 64
PUBLIC = 256
EXACT = 1e-3


def _interval(k: int, n: int, method: str = "wilson") -> str:
    if n == 0:
        return "—"
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact" if method == "cp" else "wilson")
    return f"{k}/{n} = {k / n:.1%} [{ci.low:.1%}, {ci.high:.1%}]"


def _datasets(quick: bool):
    out = [("digits", lb.load("digits"))]
    if CIFAR_NPZ.exists():
        from leakbench.data.cifar import CIFAR10_CLASSES

        out.append(("CIFAR-10", lb.load("npz", path=str(CIFAR_NPZ), classes=list(CIFAR10_CLASSES))))
    return out


def _split(ds):
    """(public images, the clients' pool of indices): the server's images are never attacked."""
    n = len(ds.images)
    return ds.images[n - PUBLIC:], torch.arange(n - PUBLIC)


def _batch(ds, pool, draw: int):
    pick = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(1000 + draw))[:B]]
    return ds.images[pick], ds.labels[pick], pick


def _matched_exact(images: torch.Tensor, x: torch.Tensor, confidence=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-original exact flags, per-original PSNR) after the best one-to-one matching."""
    flags = None if confidence is None else confidence.bool()
    method = "confident-first" if flags is not None and bool(flags.any()) else "total-mse"
    order = match(images, x, method=method, confident=flags if method == "confident-first" else None)
    paired = images[order].reshape(x.shape[0], -1).double()
    flat = x.reshape(x.shape[0], -1).double()
    err = (paired - flat).abs().amax(1)
    mse = (paired - flat).pow(2).mean(1).clamp_min(1e-20)
    return err < EXACT, (10 * torch.log10(1 / mse)).clamp(max=200)


class Tally:
    def __init__(self) -> None:
        self.exact = self.n = self.flagged = self.wrong = 0
        self.psnr = 0.0
        self.seconds = 0.0

    def add(self, exact, psnr, n, flagged=0, wrong=0, seconds=0.0):
        self.exact += int(exact.sum())
        self.n += n
        self.psnr += float(psnr.sum())
        self.flagged += flagged
        self.wrong += wrong
        self.seconds += seconds

    def row(self, *label):
        return [*label, _interval(self.exact, self.n), self.flagged, self.wrong,
                self.psnr / max(self.n, 1), self.seconds]


def _attack(name: str, shipped, ds, pool, draws: int, *, defense: str = "none", only: int | None = None,
            **observe) -> tuple[Tally, Tally, Tally]:
    """The attack on ``draws`` batches; (attack, grey chance, random-member chance) tallies on the target batch
    (``only``: on its samples of that class)."""
    got, grey, members = Tally(), Tally(), Tally()
    mean = float(ds.images.mean())
    population = ds.subset(pool)
    for draw in range(draws):
        x, y, pick = _batch(ds, pool, draw)
        obs = lb.observe(shipped, x, y, defense=defense, population=population, seed=draw, **observe)
        start = time.perf_counter()
        rec = lb.attack(name, obs)
        secs = time.perf_counter() - start
        images = rec.images.detach().float()
        exact, psnr = _matched_exact(images, x, rec.confidence)
        conf = rec.confidence.bool()
        # a flagged slot must be a sample of the aggregate: the target's, or another client's (secagg)
        everyone = ds.images[pool].reshape(len(pool), -1)
        flagged_rows = images.reshape(images.shape[0], -1)[conf]
        wrong = sum(int((everyone - r).abs().amax(1).min() >= EXACT) for r in flagged_rows)
        keep = torch.ones(B, dtype=torch.bool) if only is None else y == only
        got.add(exact[keep], psnr[keep], int(keep.sum()), int(conf.sum()), wrong, secs)
        g_exact, g_psnr = _matched_exact(torch.full_like(x, mean), x)
        grey.add(g_exact, g_psnr, B)
        taken = set(pick.tolist())
        others = torch.tensor([i for i in pool.tolist() if i not in taken])
        rand = others[torch.randperm(len(others), generator=torch.Generator().manual_seed(7 + draw))[:rec.batch_size]]
        m_exact, m_psnr = _matched_exact(ds.images[rand], x)
        members.add(m_exact, m_psnr, B)
    return got, grey, members


def recovery(quick: bool) -> None:
    draws = 1 if quick else 3
    rows = []
    for name, ds in _datasets(quick):
        public, pool = _split(ds)
        model = lb.build("mlp:1000", input_shape=ds.shape, classes=ds.num_classes, seed=0, act="relu")
        settings = [("FedSGD", "none", 1 / B, True), ("FedSGD, one s", "none", 1 / B, False),
                    ("secagg:4", "secagg:4", 1 / (4 * B), True),
                    ("FedAvg 1 epoch (local:1,0.05,16)", "local:1,0.05,16", 1 / B, True),
                    ("FedAvg 3 epochs (local:3,0.05,16)", "local:3,0.05,16", 1 / B, True)]
        if quick:
            settings = [settings[0], settings[2], settings[3]]
        grey_done = False
        for label, defense, rate, per_row in settings:
            shipped = trap_weights(model, rate=rate, calibration=public, per_row=per_row, seed=0)
            got, grey, members = _attack("trap-weights", shipped, ds, pool, draws, defense=defense)
            rows.append(got.row(name, label, "trap-weights (per-row s)" if per_row else "trap-weights (one s)"))
            if not grey_done:
                rows.append(grey.row(name, label, "chance: grey image"))
                rows.append(members.row(name, label, "chance: random members"))
                grey_done = True
            if defense == "secagg:4":
                rows.append(members.row(name, label, "chance: random members (256 slots)"))
        for label, defense in (("FedSGD", "none"), ("secagg:4", "secagg:4")):
            shipped = fishing(model, target=3, calibration=public)
            got, _, _ = _attack("fishing", shipped, ds, pool, draws, defense=defense, only=3)
            rows.append(got.row(name, label, "class fishing (class 3): of the batch's class-3 samples"))
    sources = "; CIFAR-10: the test images of ../shared/data/cifar10-test-1000.npz" if CIFAR_NPZ.exists() else \
        "; ../shared/data/cifar10-test-1000.npz absent: digits only"
    table(f"Trap weights and class fishing — exact samples of the target client, B = {B}, mlp:1000 (ReLU)",
          ["data", "setting", "attack", f"exact (max |Δ| < {EXACT:g}) [Wilson 95 %]", "flagged", "wrong flags",
           "PSNR", "seconds"], rows,
          note=f"{draws} batch(es) of {B} per cell from images the server never holds; {PUBLIC} public images "
               "calibrate the rows; fishing: only the class-3 samples reach the body (the others: none exact, "
               "by construction), its fraction is of those; chance rows: no attack" + sources)


# --------------------------------------------------------------------------- detection


def _honest(ds, spec: str, seed: int, init: str = "default"):
    return lb.build(spec, input_shape=ds.shape, classes=ds.num_classes, seed=seed, act="relu", init=init)


def adaptive_trap(model, public, rate: float, seed: int):
    """Trap rows whose negative entries are a Bernoulli(½) draw per entry (no exact half): a server that knows the
    sign-balance check.  Same magnitudes, per-row scales calibrated as trap_weights does."""
    shipped = trap_weights(model, rate=rate, calibration=public, seed=seed)
    layer = shipped.get_submodule(shipped.trap_layer)
    d = layer.in_features
    gen = torch.Generator().manual_seed(10_000 + seed)
    m, _ = trap_rows(layer.out_features, d, generator=gen, bound=float(layer.weight.detach().abs().max()))
    negative = torch.rand((layer.out_features, d), generator=gen) < 0.5
    s = trap_scales(m, negative, public, rate)
    with torch.no_grad():
        layer.weight.copy_(torch.where(negative, -m, s[:, None] * m).to(layer.weight))
    return shipped


def _malicious(quick: bool):
    """(kind, make(ds, seed) → (model held before, shipped)) of the library's malicious models."""
    mlps = ["mlp:64", "mlp:256", "mlp:1000", "mlp:256-128"]
    cnns = ["cnn:3-8-1-1", "cnn:3-16-2-1,3-32-2-1", "lenet"]

    def trap(ds, seed):
        before = _honest(ds, mlps[seed % len(mlps)], seed)
        rate = [1 / 16, 1 / 32, 1 / 64, 1 / 128][seed % 4]
        return before, trap_weights(before, rate=rate, calibration=_split(ds)[0], seed=seed)

    def trap_block(ds, seed):
        before = _honest(ds, cnns[seed % len(cnns)], seed)
        return before, trap_weights(before, neurons=[200, 500, 1000][seed % 3], rate=1 / 64,
                                    calibration=_split(ds)[0], seed=seed)

    def imprinted(ds, seed):
        before = _honest(ds, (mlps + cnns)[seed % 7], seed)
        return before, imprint(before, bins=[16, 64, 128][seed % 3], calibration=_split(ds)[0], seed=seed)

    def head(ds, seed):
        before = _honest(ds, (mlps + cnns)[seed % 7], seed)
        return before, random_head(before, width=[500, 2000][seed % 2], seed=seed)

    def fished(ds, seed):
        before = _honest(ds, (mlps + cnns)[seed % 7], seed)
        return before, fishing(before, target=seed % ds.num_classes, calibration=_split(ds)[0])

    def feature_fished(ds, seed):  # the threshold placed on labelled public images (a class they hold)
        before = _honest(ds, (mlps + cnns)[seed % 7], seed)
        labels = ds.labels[len(ds.images) - PUBLIC:]
        return before, fishing(before, target=int(labels[seed % len(labels)]), quantile=[0.15, 0.33, 0.5][seed % 3],
                               calibration=(_split(ds)[0], labels))

    def refished_(ds, seed):  # a later round of fishing-rounds: another feature, threshold and sharpness
        before, shipped = feature_fished(ds, seed)
        j, centre, spread = shipped.fishing_candidates[seed % len(shipped.fishing_candidates)]
        return before, refished(shipped, centre + spread * (seed % 5 - 2) / 2, 1e5 / spread, feature=j)

    def lokied(ds, seed):  # the model client (seed mod L) receives: its own kernels
        before = _honest(ds, (mlps + cnns)[seed % 7], seed)
        shipped = loki_model(before, clients=[2, 4, 8][seed % 3], bins=[64, 256][seed % 2], calibration=_split(ds)[0],
                             seed=seed)
        with torch.no_grad():
            for name, value in shipped.loki.client_overrides(seed % shipped.loki.clients).items():
                shipped.loki.get_parameter(name).copy_(value)
        return before, shipped

    def adaptive(ds, seed):
        before = _honest(ds, mlps[seed % len(mlps)], seed)
        return before, adaptive_trap(before, _split(ds)[0], [1 / 32, 1 / 64][seed % 2], seed)

    return [("trap weights (first layer)", trap), ("trap block (K neurons)", trap_block), ("imprint block", imprinted),
            ("random head", head), ("class fishing", fished), ("feature fishing", feature_fished),
            ("fishing-rounds' later round", refished_), ("LOKI (one client's model)", lokied),
            ("adaptive trap (Bernoulli signs)", adaptive)]


def _sgd_checkpoints(ds, spec: str, lr: float, epochs: int, seed: int):
    """(previous, current) pairs of an SGD run over the clients' pool (batch 32), one per epoch."""
    model = _honest(ds, spec, seed)
    _, pool = _split(ds)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    prev = copy.deepcopy(model)
    for _ in range(epochs):
        perm = pool[torch.randperm(len(pool), generator=gen)]
        for i in range(0, len(perm), 32):
            idx = perm[i:i + 32]
            loss = torch.nn.functional.cross_entropy(model(ds.images[idx]), ds.labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        yield prev, copy.deepcopy(model)
        prev = copy.deepcopy(model)


def _fedavg_checkpoints(ds, spec: str, rounds: int, seed: int):
    """(round t − 1, round t) global models of a FedAvg run (4 clients, 1 local epoch of batch 16, lr 0.05)."""
    config = FederatedEntry(rounds=[rounds], clients=4, local_epochs=1, batch_size=16, lr=0.05).model_dump()
    model = _honest(ds, spec, seed)
    run = Run(model, ds, "none", config, seed)
    prev = copy.deepcopy(model)
    for t in range(1, rounds + 1):
        run.step(model, t)
        yield prev, copy.deepcopy(model)
        prev = copy.deepcopy(model)


def _honest_sets(quick: bool):
    """(group, generator of (model before or None, received, dataset))."""
    data = _datasets(quick)
    families = ["mlp:64", "mlp:256", "mlp:1000", "mlp:256-128", "cnn:3-8-1-1", "cnn:3-16-2-1,3-32-2-1", "lenet",
                "convnet-8", "twolayer:100"]
    inits = ["default", "uniform", "gaussian", "small"]
    seeds = range(1) if quick else range(4)

    def inits_():
        for _, ds in data:
            for spec in families:
                for init in inits:
                    for seed in seeds:
                        try:
                            yield None, _honest(ds, spec, seed, init), ds
                        except Exception:  # noqa: BLE001 - a family that does not fit this shape (ConvNet on 8×8)
                            continue

    def sgd():
        for name, ds in data:
            specs = ["mlp:100", "mlp:1000", "cnn:3-16-2-1,3-32-2-1"] if name == "digits" else ["mlp:256", "cnn:3-16-2-1,3-32-2-1"]
            for spec in specs[: 2 if quick else None]:
                for lr in (0.01, 0.1):
                    for before, after in _sgd_checkpoints(ds, spec, lr, 2 if quick else (8 if name == "digits" else 4),
                                                          seed=1):
                        yield before, after, ds

    def fedavg():
        name, ds = data[0]
        for spec in ["mlp:256", "cnn:3-16-2-1,3-32-2-1"][: 1 if quick else None]:
            for before, after in _fedavg_checkpoints(ds, spec, 3 if quick else 10, seed=2):
                yield before, after, ds

    return [("fresh initialisations (first round)", inits_), ("SGD checkpoints vs the epoch before", sgd),
            ("FedAvg global models vs the round before", fedavg)]


def detection(quick: bool) -> None:
    per_kind = 6 if quick else 30
    rows, fired_by = [], []
    for kind, make in _malicious(quick):
        caught = {"first": 0, "later": 0, "later, no data": 0}
        checks: dict[str, int] = {}
        n = 0
        for _, ds in _datasets(quick):
            for seed in range(per_kind // 2):
                before, shipped = make(ds, seed)
                x, y, _ = _batch(ds, _split(ds)[1], seed)
                first = inspect(None, shipped, x=x, y=y)
                later = inspect(before, shipped, x=x, y=y)
                blind = inspect(before, shipped)
                caught["first"] += first.suspicious
                caught["later"] += later.suspicious
                caught["later, no data"] += blind.suspicious
                for c in later.checks:
                    checks[c] = checks.get(c, 0) + 1
                n += 1
        rows.append([kind, n, _interval(caught["first"], n, "cp"), _interval(caught["later"], n, "cp"),
                     _interval(caught["later, no data"], n, "cp")])
        fired_by.append([kind, ", ".join(f"{c} {k}/{n}" for c, k in sorted(checks.items(), key=lambda t: -t[1]))])
    table("The client's check on the library's malicious models — detected [Clopper–Pearson 95 %]",
          ["server's move", "models", "first round (no model before)", "later round (model before)",
           "later round, no client data"], rows,
          note="digits and CIFAR-10, architectures × seeds × options per move; the client's batch of 64 from images "
               "the server never holds; 'adaptive trap' is not a library move: a server hiding the exact half")
    table("Which checks fired (later round)", ["server's move", "checks"], fired_by)
    rows, flagged = [], []
    total = hits = 0
    for group, make in _honest_sets(quick):
        n = k = 0
        for before, model, ds in make():
            x, y, _ = _batch(ds, _split(ds)[1], n)
            report = inspect(before, model, x=x, y=y)
            n += 1
            if report.suspicious:
                k += 1
                flagged.append([group, report.reason[:160]])
        rows.append([group, _interval(k, n, "cp")])
        total, hits = total + n, hits + k
    rows.append(["all honest models", _interval(hits, total, "cp")])
    table("The client's check on honest models — false positives [Clopper–Pearson 95 %]", ["honest models", "flagged"],
          rows, note="initialisations: every family × init (default, uniform, gaussian, small) × seeds, digits and "
                     "CIFAR-10; SGD: lr 0.01 and 0.1, batch 32; FedAvg: 4 clients, 1 local epoch, lr 0.05, 10 rounds")
    if flagged:
        table("Honest models flagged", ["group", "reason"], flagged)


def loki_recovery(quick: bool) -> None:
    """LOKI under secure aggregation of L = 4 clients: the target client's samples and every client's, beside
    Robbing the Fed's single imprint block (the same bins for all clients) and chance."""
    draws = 1 if quick else 3
    clients, bins = 4, 256
    rows = []
    for name, ds in _datasets(quick):
        public, pool = _split(ds)
        population = ds.subset(pool)
        model = lb.build("mlp:256", input_shape=ds.shape, classes=ds.num_classes, seed=0, act="relu")
        shipped = loki_model(model, clients=clients, bins=bins, calibration=public, seed=0)
        settings = [("FedSGD, one client", "none"), ("secagg:4", "secagg:4"),
                    ("secagg:4 + FedAvg 1 epoch (local:1,0.05,16)", "secagg:4+local:1,0.05,16"),
                    ("secagg:4 + FedAvg 3 epochs (local:3,0.05,16)", "secagg:4+local:3,0.05,16")]
        if quick:
            settings = settings[1:3]
        for label, defense in settings:
            got, grey, members = _attack("loki", shipped, ds, pool, draws, defense=defense)
            rows.append(got.row(name, label, f"loki (K = {bins}): target client"))
            if defense.startswith("secagg"):
                everyone = Tally()
                for draw in range(draws):
                    x, y, _ = _batch(ds, pool, draw)
                    obs = lb.observe(shipped, x, y, defense=defense, population=population, seed=draw)
                    rec = lb.attack("loki", obs)
                    others = other_batches(population, clients - 1, B, like_x=x, like_y=y,
                                           generator=torch.Generator().manual_seed(draw))
                    union = torch.cat([x, *[o[0] for o in others]])
                    exact, psnr = _matched_exact(rec.images.detach().float(), union)
                    everyone.add(exact, psnr, union.shape[0])
                rows.append(everyone.row(name, label, f"loki (K = {bins}): all {clients} clients"))
            if defense == "secagg:4":
                plain = imprint(model, bins=bins, calibration=public, seed=0)
                rtf, _, _ = _attack("robbing-the-fed", plain, ds, pool, draws, defense=defense)
                rows.append(rtf.row(name, label, f"control: one imprint block for all (K = {bins})"))
                rows.append(grey.row(name, label, "chance: grey image"))
                rows.append(members.row(name, label, f"chance: random members ({clients * B} slots)"))
    table(f"LOKI under secure aggregation — exact samples, B = {B} per client, mlp:256 (ReLU, untrained: "
          "accuracy at chance)",
          ["data", "setting", "attack", f"exact (max |Δ| < {EXACT:g}) [Wilson 95 %]", "flagged", "wrong flags",
           "PSNR", "seconds"], rows,
          note=f"{draws} batch(es) of {B} per cell; the other 3 clients' batches drawn from the same pool; {PUBLIC} "
               "public images place the bins (never attacked); each client trains its own customised model "
               "(scale 1, slope 1e-3, gain 1); the imprint control uses the same K and calibration")


def run(quick: bool = False) -> None:
    torch.manual_seed(0)
    recovery(quick)
    loki_recovery(quick)
    detection(quick)
