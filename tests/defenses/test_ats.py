"""ATS (Gao et al. 2021): the policy's operations against PIL, seeded signs, the client's gradient at T(x), bad specs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance

from leakbench.defenses import parse, share
from leakbench.defenses.ats import (
    IMPLEMENTED,
    LIBRARY,
    apply_op,
    draw_hybrid,
    draw_signs,
    hybrid_transform,
    magnitude,
    parse_policy,
    signed_count,
    transform,
)
from leakbench.defenses.pipeline import mean_gradient
from leakbench.errors import ConfigError
from leakbench.evaluation.training.seeds import seeds_refusal
from leakbench.losses import get_loss


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _image(seed=0, size=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def _tensor(img):
    return torch.tensor(np.asarray(img), dtype=torch.float32).permute(2, 0, 1)[None] / 255


@pytest.mark.parametrize("sign", [-1.0, 1.0])
@pytest.mark.parametrize("op", ["translateX", "translateY"])
def test_translations_equal_pil_affine(op, sign):
    img = Image.fromarray(_image(1))
    t = magnitude(op, 9) * 8 * sign
    ref = img.transform(img.size, Image.AFFINE, (1, 0, t, 0, 1, 0) if op == "translateX" else (1, 0, 0, 0, 1, t),
                        fillcolor=(0, 0, 0))
    got = apply_op(_tensor(img), op, magnitude(op, 9), torch.tensor([sign]))
    assert torch.allclose(got, _tensor(ref), atol=1e-6)


@pytest.mark.parametrize("op, enhancer", [("brightness", ImageEnhance.Brightness), ("color", ImageEnhance.Color),
                                          ("contrast", ImageEnhance.Contrast)])
def test_blends_follow_pil_image_enhance_within_a_grey_level(op, enhancer):
    img = Image.fromarray(_image(2))
    for sign in (-1.0, 1.0):
        m = magnitude(op, 6)
        ref = _tensor(enhancer(img).enhance(1 + sign * m))
        got = apply_op(_tensor(img), op, m, torch.tensor([sign]))
        assert float((got - ref).abs().max()) <= 1.6 / 255  # PIL rounds to 8 bits (and contrast's mean to a level)


def test_rotation_and_shear_at_magnitude_zero_are_the_identity_and_rotation_fills_grey():
    x = torch.rand(2, 3, 8, 8, generator=_gen(3))
    ones = torch.ones(2)
    assert torch.allclose(apply_op(x, "rotate", 0.0, ones), x, atol=1e-6)
    assert torch.allclose(apply_op(x, "shearY", 0.0, ones), x, atol=1e-5)
    corner = apply_op(torch.zeros(1, 1, 8, 8), "rotate", 30.0, torch.ones(1))[0, 0, 0, 0]
    assert abs(float(corner) - 128 / 255) < 1e-6


def test_the_client_gradient_is_the_plain_gradient_at_the_transformed_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Tanh(), torch.nn.Flatten(),
                                torch.nn.Linear(2 * 64, 4))
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = torch.rand(3, 1, 8, 8, generator=_gen(4)), torch.tensor([0, 1, 3])
    loss_fn = get_loss("ce")
    got = share("ats:3-1-7", model, params, x, y, loss_fn, generator=_gen(5)).tensors
    indices = parse_policy("3-1-7")
    want = mean_gradient(model, params, transform(x, indices, draw_signs(3, indices, _gen(5))), y, loss_fn, _gen())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    other = share("ats:3-1-7", model, params, x, y, loss_fn, generator=_gen(6)).tensors
    assert not all(torch.equal(a, b) for a, b in zip(got, other))  # fresh signs per round
    assert "ats" in seeds_refusal(parse("ats"), model)


def test_policies_searched_random_and_explicit():
    assert parse("ats").indices == (3, 1, 7) and parse("ats:43-18-18").indices == (43, 18, 18)
    a, b, c = parse("ats:random"), parse("ats:random,0"), parse("ats:random,1")
    assert a.indices == b.indices and len(a.indices) == 3
    assert all(LIBRARY[i][0] in IMPLEMENTED for i in a.indices + c.indices)
    assert parse("ats:2-6").describe()["operations"] == ["rotate:6.667", "shearY:0.06667"]
    assert parse(parse("ats:random,1").spec).indices == c.indices


def test_a_hybrid_transforms_each_image_by_its_own_policy():
    """Against the images transformed one at a time by the policy and signs each drew."""
    defense = parse("ats:3-1-7/43-18-18")
    assert defense.policies == ((3, 1, 7), (43, 18, 18)) and len(defense.describe()["hybrid"]) == 2
    x = torch.rand(16, 1, 8, 8, generator=_gen(7))
    choice, signs = draw_hybrid(16, defense.policies, _gen(8))
    assert set(choice.tolist()) == {0, 1} and signs.shape == (16, 3)
    got = hybrid_transform(x, defense.policies, choice, signs)
    for i in range(16):
        indices = defense.policies[int(choice[i])]
        want = transform(x[i:i + 1], indices, signs[i:i + 1, :signed_count(indices)])
        assert torch.equal(got[i:i + 1], want)
    # a single policy draws and transforms exactly as before hybrids existed
    single = parse("ats:3-1-7").policies
    choice, signs = draw_hybrid(3, single, _gen(9))
    assert torch.equal(signs, draw_signs(3, single[0], _gen(9))) and not choice.any()


@pytest.mark.parametrize("spec, field", [("ats:50", "library indices"), ("ats:foo", "field policy"),
                                         ("ats:11", "posterize"), ("ats:1-1-1-1-1-1-1-1-1", "field policy"),
                                         ("ats:3-1-7/", "hybrid"), ("ats:1/2/3/6/7", "hybrid"),
                                         ("ats:3-1-7/11", "posterize")])
def test_bad_specs_are_one_line_errors_naming_the_field(spec, field):
    with pytest.raises(ConfigError) as err:
        parse(spec)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_vectors_are_refused_in_the_round():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="B×C×H×W"):
        share("ats", model, {n: p.detach() for n, p in model.named_parameters()}, torch.rand(2, 4),
              torch.tensor([0, 1]), get_loss("ce"), generator=_gen())
