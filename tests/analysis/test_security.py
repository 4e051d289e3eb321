"""Security metric (Chen & Campbell 2022, eq. 12): Table 1's rank deficiencies and metric values."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.analysis import SecurityReport, security_metric
from leakbench.analysis.security import numerical_rank, stacked_system
from leakbench.errors import ConfigError, UnsupportedThreatModel

#: Table 1 of the paper: spec → (rd_i per conv layer, metric as printed, FC input width).
TABLE1 = {
    "cnn:3-6-1-0": ([0], 0, 5400),                                   # CNN2 Variant 1
    "cnn:4-6-2-0": ([-1470], -1470, 1350),                           # CNN2 Variant 2
    "cnn:3-6-1-0,4-3-2-0": ([0, -4533], -2266, 588),                 # CNN3 Variant 1
    "cnn:4-6-2-0,3-3-2-0": ([-1470, -1050], -1995, 147),             # CNN3 Variant 2
    "cnn:3-6-1-0,3-9-1-0": ([0, 0], 0, 7056),                        # CNN3 Variant 3
    "cnn:3-1-1-0,3-6-1-0": ([-2146, 0], -2146, 4704),                # CNN3 Variant 4
    "cnn:3-6-1-0,4-5-2-0,4-3-1-0": ([0, -3965, -386], -2772, 363),   # CNN4 Variant 1
    "cnn:5-16-1-0,5-6-2-0,5-32-1-2": ([0, -9316, 0], -6211, 4608),   # CNN4 Variant 2
}
FAST = ["cnn:4-6-2-0", "cnn:4-6-2-0,3-3-2-0", "cnn:3-1-1-0,3-6-1-0", "cnn:3-6-1-0,4-3-2-0"]


def check(spec: str, report: SecurityReport) -> None:
    rds, metric, fc = TABLE1[spec]
    assert report.rank_deficiencies == rds
    assert round(report.metric) == metric
    assert report.fc_input_dim == fc


@pytest.mark.parametrize("spec", FAST)
def test_table1_fast_architectures(spec):
    check(spec, security_metric(spec, (3, 32, 32)))


@pytest.mark.slow
@pytest.mark.parametrize("spec", sorted(set(TABLE1) - set(FAST)))
def test_table1_remaining_architectures(spec):
    check(spec, security_metric(spec, (3, 32, 32)))


def test_metric_is_the_position_weighted_mean():
    report = security_metric("cnn:4-6-2-0,3-3-2-0", (3, 32, 32))
    rd1, rd2 = report.rank_deficiencies
    assert report.metric == pytest.approx((2 * rd1 + 1 * rd2) / 2)
    assert not report.full_rank and report.to_dict()["metric_rounded"] == -1995


def test_generic_in_weights_and_upstream_gradients():
    data = lb.load("photos", size=32)
    x, y = data.batch(1, seed=0)
    a = security_metric("cnn:4-6-2-0,3-3-2-0", (3, 32, 32), seed=3)
    model = lb.build("cnn:4-6-2-0,3-3-2-0", input_shape=(3, 32, 32), classes=data.num_classes, act="tanh",
                     init="uniform", seed=7, dtype=torch.float64)
    b = security_metric(model, x=x.double(), y=y)
    assert a.rank_deficiencies == b.rank_deficiencies and b.upstream.startswith("backward")


@pytest.mark.parametrize("seed", range(6))
def test_numerical_rank_matches_svd_and_the_channel_count_formula(seed):
    g = torch.Generator().manual_seed(seed)
    c, o, k, s = [int(v) for v in torch.randint(1, 4, (4,), generator=g)]
    h = 6 + int(torch.randint(0, 5, (1,), generator=g))
    conv = nn.Conv2d(c, o, k + 1, stride=s, bias=False).double()
    delta = torch.randn(conv(torch.zeros(1, c, h, h, dtype=torch.float64)).numel(), generator=g, dtype=torch.float64)
    w, kmat = stacked_system(conv, (c, h, h), delta)
    dense = torch.cat([torch.from_numpy(w.toarray()), torch.from_numpy(kmat)])
    rank = numerical_rank(w, kmat)
    assert rank == int(torch.linalg.matrix_rank(dense))
    # weight sharing: Σ_cuv W[o',c,u,v]·K-row(o,c,u,v) lies in W's row space for every (o, o') pair
    assert rank <= min(c * h * h, w.shape[0] + kmat.shape[0] - o * o)


def test_ra_i_counts_constraints_against_unknowns():
    report = security_metric("cnn:4-6-2-0", (3, 32, 32))
    layer = report.layers[0]
    assert (layer.ra_unknowns, layer.ra_constraints) == (3072, 1350 + 288)
    assert layer.ra_i == 3072 - 1638


def test_models_without_conv_and_bad_inputs():
    report = security_metric("mlp:10", (3, 8, 8))
    assert report.layers == [] and report.metric == 0 and report.notes
    with pytest.raises(ConfigError, match="input_shape"):
        security_metric("cnn:3-6-1-0")
    with pytest.raises(UnsupportedThreatModel, match="BatchNorm2d"):
        security_metric("convnet-4", (3, 32, 32))


def _ra_by_hand(layers):
    """RA-i from the top convolution down (Zhu & Blaschko 2021, Sec. 3.3): v below = the surplus above."""
    virtual, out = 0, []
    for layer in reversed(layers):
        ra = layer.input_dim - (layer.output_dim + layer.gradient_rows + virtual)
        out.append((virtual, ra))
        virtual = max(0, -ra)
    return out[::-1]


def test_ra_i_propagates_virtual_constraints_through_every_layer():
    """Three stride-2 convolutions on 3×16×16: each layer above leaves a surplus that becomes the virtual
    constraints of the layer below, all the way to the input layer."""
    report = security_metric("cnn:3-4-2-1,3-4-2-1,3-4-2-1", (3, 16, 16))
    layers = report.layers
    assert [(l.input_dim, l.output_dim, l.gradient_rows) for l in layers] == [(768, 256, 108), (256, 64, 144),
                                                                               (64, 16, 144)]
    # top: 64 − (16 + 144) = −96 → 96 virtual below; middle: 256 − (64 + 144 + 96) = −48 → 48 below;
    # input layer: 768 − (256 + 108 + 48) = 356
    assert [(l.ra_virtual, l.ra_i) for l in layers] == [(48, 356), (96, -48), (0, -96)]
    assert [(l.ra_virtual, l.ra_i) for l in layers] == _ra_by_hand(layers)
