"""TAG: gradient matching on embeddings beats the unigram chance level; seeded; refusals and bad options."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, UnsupportedThreatModel
from leakbench.metrics.text_metrics import text_scores, unigram_chance


@pytest.fixture(scope="module")
def data():
    return lb.load("text", split="test", context=16)


def kw(data):
    return dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)


@pytest.fixture(scope="module")
def decoder_obs(data):
    model = lb.build("gpt:layers=1,width=64,heads=4", input_shape=data.shape, classes=data.vocab_size, seed=0)
    x, y = data.batch(1, seed=2)
    return x, lb.observe(model, x, y)  # labels unknown: TAG optimises soft next-token targets too


def test_beats_the_unigram_chance_level_at_batch_one(data, decoder_obs):
    x, obs = decoder_obs
    rec = lb.attack("tag", obs, preset="quick", seed=0)
    got = text_scores(rec.images, x, **kw(data))
    chance = unigram_chance(x, lb.load("text").unigram(), draws=16, **kw(data))
    assert got["rouge1"] > chance["rouge1"] + 0.2 and got["token_acc"] > chance["token_acc"] + 0.2
    assert rec.trace["loss"][-1] < 0.6 * rec.trace["loss"][0]
    short = [lb.attack("tag", obs, iterations=3, seed=5).images for _ in range(2)]
    assert torch.equal(*short)  # seeded


def test_encoder_with_known_labels(data):
    cls = data.with_task("classify")
    model = lb.build("bert:layers=1,width=64,heads=4,vocab=2000", input_shape=data.shape, classes=21, seed=0)
    x, y = cls.batch(1, seed=2)
    rec = lb.attack("tag", lb.observe(model, x, y, labels_known=True), iterations=300, lr=0.02)
    chance = unigram_chance(x, lb.load("text").unigram(), draws=16, **kw(data))
    assert text_scores(rec.images, x, **kw(data))["rouge1"] > chance["rouge1"] + 0.1
    assert bool((rec.images[x == data.pad_id] == data.pad_id).all())  # padding kept where the mask says


def test_refusals_and_bad_options(decoder_obs):
    _, obs = decoder_obs
    with pytest.raises(ConfigError, match="option iterations"):
        lb.attack("tag", obs, iterations=0)
    with pytest.raises(ConfigError, match="option alpha"):
        lb.attack("tag", obs, alpha=-1.0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
    x = torch.randint(0, 20, (1, 4))
    with pytest.raises(UnsupportedThreatModel, match="text transformers"):
        lb.attack("tag", lb.observe(model, x, x))


@pytest.mark.slow
def test_strong_noise_degrades_tag_to_chance(data, decoder_obs):
    # one run per level: a single TAG run varies too much for a strict ordering of nearby σ (measured: σ = 0.01
    # scored 0.57 and σ = 0 0.48 once), so this checks the ends only
    x, obs = decoder_obs
    y = data.batch(1, seed=2)[1]
    got = [text_scores(lb.attack("tag", lb.observe(obs.model, x, y, defense=d), preset="quick").images, x,
                       **kw(data))["rouge1"] for d in (None, "noise:1.0")]
    chance = unigram_chance(x, lb.load("text").unigram(), draws=16, **kw(data))
    assert got[0] > got[1] and got[1] <= chance["rouge1"] + 0.15, (got, chance)


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["tag", "lamp"])
def test_noise_of_growing_sigma_degrades_tag_and_lamp(data, decoder_obs, attack):
    """Mean ROUGE-1 over 3 seeds at σ = 0.3, 3 and 30 × the gradient's RMS falls, to the unigram chance level.
    Measured (this sentence, 3 seeds): TAG 0.50 at σ = 0, 0.64 / 0.28 / 0.03; LAMP 0.54, 0.68 / 0.51 / 0.03 —
    the smallest σ scored *above* no noise for both (all three seeds for TAG), so σ = 0 is not in the ordering."""
    x, obs = decoder_obs
    y = data.batch(1, seed=2)[1]
    rms = float(torch.cat([g.flatten() for g in obs.gradients]).pow(2).mean().sqrt())
    means = []
    for k in (0.3, 3.0, 30.0):
        scores = [text_scores(lb.attack(attack, lb.observe(obs.model, x, y, defense=f"noise:{k * rms:.3g}", seed=s),
                                        preset="quick", seed=s).images, x, **kw(data))["rouge1"] for s in range(3)]
        means.append(sum(scores) / 3)
    chance = unigram_chance(x, lb.load("text").unigram(), draws=16, **kw(data))
    assert means[0] > means[1] > means[2], means
    assert means[2] <= chance["rouge1"] + 0.1, (means, chance)
