"""Text transformers from specs (gpt, bert), their observations, and bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.losses import get_loss
from leakbench.models.spec import canonical_spec


def gpt(vocab=50, context=8, spec="gpt:layers=2,width=16,heads=2", seed=0):
    return lb.build(spec, input_shape=(context,), classes=vocab, seed=seed)


def test_spec_grammar_and_canonical_form():
    assert canonical_spec("GPT: width=32") == "gpt:layers=2,width=32,heads=4"
    assert canonical_spec("bert:vocab=100") == "bert:layers=2,width=64,heads=4,vocab=100"
    m = gpt()
    assert m.spec == "gpt:layers=2,width=16,heads=2" and m.init == "gpt"
    again = lb.build(m.spec, input_shape=m.input_shape, classes=m.classes, **m.build_options)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters()))
    other = gpt(seed=1)
    assert not torch.equal(m.tok.weight, other.tok.weight)


@pytest.mark.parametrize("spec, message", [
    ("gpt:depth=2", "keys layers, width, heads"),
    ("gpt:width=0", "positive integer for width"),
    ("bert:layers=1", "vocabulary size"),
    ("gpt:width=10,heads=4", "divisible by heads"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ConfigError, match=message):
        lb.build(spec, input_shape=(8,), classes=50)


def test_text_model_needs_a_sequence_shape():
    with pytest.raises(ConfigError, match="input_shape"):
        lb.build("gpt", input_shape=(3, 8, 8), classes=50)


def test_decoder_is_causal():
    m = gpt()
    x = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 5] = (changed[:, 5] % 49) + 1
    a, b = m(x), m(changed)
    assert a.shape == (2, 8, 50)
    assert torch.allclose(a[:, :5], b[:, :5]) and not torch.allclose(a[:, 5:], b[:, 5:])


def test_encoder_ignores_padding():
    m = lb.build("bert:layers=1,width=16,heads=2,vocab=50", input_shape=(8,), classes=3, seed=0)
    short = torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0]])
    shorter = torch.tensor([[5, 6, 7, 0, 0]])
    assert m(short).shape == (1, 3) and torch.allclose(m(short), m(shorter), atol=1e-6)


def test_next_token_cross_entropy_skips_ignored_positions():
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([[1, 2, -100, -100], [3, 4, 5, 6]])
    keep = y != -100
    manual = -torch.log_softmax(logits, -1)[keep].gather(1, y[keep][:, None]).mean()
    assert torch.allclose(get_loss("ce")(logits, y), manual)


def test_observe_tokens_equals_a_captured_gradient_and_states_grants():
    m = gpt()
    x = torch.randint(1, 50, (3, 8), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    y[:, -1] = -100
    obs = lb.observe(m, x, y, labels_known=True)
    assert obs.input_shape == (8,) and obs.num_classes == 50 and obs.extras["text"]["seq_len"] == 8
    assert "vocabulary known" in obs.extras["text"]["grants"]
    m.zero_grad()
    get_loss("ce")(m(x), y).backward()
    captured = lb.Observation.from_gradients(m, [p.grad for p in m.parameters()], batch_size=3, labels=y)
    assert all(torch.allclose(a, b) for a, b in zip(obs.shared, captured.shared))
    assert torch.equal(obs.labels, y)


def test_encoder_classification_observation():
    m = lb.build("bert:layers=1,width=16,heads=2,vocab=50", input_shape=(8,), classes=3, seed=0)
    obs = lb.observe(m, torch.randint(1, 50, (2, 8)), torch.tensor([0, 2]))
    assert obs.num_classes == 3 and obs.shared[0].abs().sum() > 0


class MyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.out = nn.Linear(8, 30)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


def test_a_users_own_module():
    m = MyLM()
    x = torch.randint(0, 30, (2, 5))
    obs = lb.observe(m, x, x)
    assert obs.extras["text"]["vocab_size"] == 30 and len(obs.shared) == 3
    with pytest.raises(ConfigError, match="tokenizer does not match"):
        lb.observe(m, x + 30, x)


@pytest.mark.parametrize("make_x, make_y, message", [
    (lambda: torch.randint(1, 50, (2, 9)), lambda: torch.zeros(2, 9, dtype=torch.long), "at most 8 tokens"),
    (lambda: torch.full((2, 8), 60), lambda: torch.zeros(2, 8, dtype=torch.long), "tokenizer does not match"),
    (lambda: torch.ones(2, 8, dtype=torch.long), lambda: torch.zeros(2, 8), "integer targets"),
    (lambda: torch.ones(2, 8, dtype=torch.long), lambda: torch.full((2, 8), -100), "at least one target"),
    (lambda: torch.ones(0, 8, dtype=torch.long), lambda: torch.zeros(0, 8, dtype=torch.long), "non-empty"),
    (lambda: torch.ones(2, 8, dtype=torch.long), lambda: torch.zeros(3, dtype=torch.long), "shape"),
])
def test_bad_token_batches_one_line(make_x, make_y, message):
    with pytest.raises(ConfigError, match=message):
        lb.observe(gpt(), make_x(), make_y())


def test_gradient_defenses_apply_to_token_batches():
    m = gpt()
    x = torch.randint(1, 50, (3, 8), generator=torch.Generator().manual_seed(2))
    y = torch.roll(x, -1, 1)
    y[:, -1] = -100
    clean = lb.observe(m, x, y)
    dp = lb.observe(m, x, y, defense="dpsgd:0.01,0.0")  # per-sample clipping only: a smaller gradient
    assert dp.defense.startswith("dpsgd") and all(torch.isfinite(t).all() for t in dp.shared)
    norm = lambda o: torch.sqrt(sum((t ** 2).sum() for t in o.shared))  # noqa: E731
    assert float(norm(dp)) <= 0.01 + 1e-6 < float(norm(clean))
    noisy = lb.observe(m, x, y, defense="noise:0.1", seed=1)
    assert not torch.allclose(noisy.shared[0], clean.shared[0])


def test_bundled_text_against_a_mismatched_model_one_line():
    # the bundled tokenizer (2 000 ids) against an encoder built for 500 ids, and sentences longer than its context
    data = lb.load("text", split="test", context=16)
    x, y = data.with_task("classify").batch(2, seed=0)
    small = lb.build("bert:layers=1,width=32,heads=4,vocab=500", input_shape=(16,), classes=21, seed=0)
    with pytest.raises(ConfigError, match=r"ids in 0\.\.499 .*tokenizer does not match the model") as err:
        lb.observe(small, x, y)
    assert "\n" not in str(err.value)
    short = lb.build("gpt:layers=1,width=32,heads=4", input_shape=(8,), classes=data.vocab_size, seed=0)
    xl, yl = data.batch(2, seed=0)
    with pytest.raises(ConfigError, match="at most 8 tokens .*context"):
        lb.observe(short, xl, yl)
