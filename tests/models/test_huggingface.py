"""Hugging Face GPT-2 models (built from a config, nothing downloaded) handed to leakbench.build."""
from __future__ import annotations

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError
from leakbench.metrics import text_scores, unigram_chance
from leakbench.models.huggingface import from_gpt2
from leakbench.models.transformers import TextTransformer

transformers = pytest.importorskip("transformers", reason="needs the transformers extra "
                                                          "(pip install 'leakbench[transformers]')")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    return lb.load("text", context=16, split="test")


def _gpt2(vocab: int, width: int = 64, **config):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=width, n_layer=2, n_head=4,
                                  bos_token_id=1, eos_token_id=1, pad_token_id=0, **config)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_a_gpt2_model_is_built_as_the_same_function(data):
    hf = _gpt2(data.vocab_size)
    model = lb.build(hf)
    assert isinstance(model, TextTransformer) and model.width == 64 and len(model.blocks) == 2
    x, _ = data.batch(4, seed=1)
    with torch.no_grad():
        theirs, ours = hf(input_ids=x).logits, model(x)
    assert float((theirs - ours).abs().max()) < 1e-5 * float(theirs.abs().max())


@pytest.mark.parametrize("B", [1, 4])
def test_dager_recovers_a_gpt2_clients_batch_exactly(data, B):
    model = lb.build(_gpt2(data.vocab_size, width=96))  # B·T ≤ 64 < width: DAGER's span test applies
    x, y = data.batch(B, seed=2)
    rec = lb.attack("dager", lb.observe(model, x, y))
    kw = dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)
    assert text_scores(rec.images, x, **kw)["exact"] == 1.0 and all(rec.trace["exact"])
    assert unigram_chance(x, data.unigram(), **kw)["exact"] == 0.0


def test_a_gpt2_variant_leakbench_does_not_model_is_refused_with_the_field(data):
    with pytest.raises(ConfigError, match="activation 'quick_gelu'.*config.activation_function"):
        from_gpt2(_gpt2(data.vocab_size, activation_function="quick_gelu"))
    with pytest.raises(ConfigError, match="expected a transformers GPT2LMHeadModel, got Linear"):
        from_gpt2(torch.nn.Linear(2, 2))
