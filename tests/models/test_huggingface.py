"""Hugging Face models (built from configs, nothing downloaded) handed to leakbench.build: GPT-2 converted, BERT and
Llama wrapped (HFTextModel) with DAGER's span view."""
from __future__ import annotations

import copy

import pytest
import torch

import leakbench as lb
from leakbench.errors import ConfigError, NothingRecovered, UnsupportedThreatModel
from leakbench.metrics import text_scores, unigram_chance
from leakbench.models.huggingface import HFTextModel, from_gpt2
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


# --------------------------------------------------------------------------- BERT and Llama, wrapped


def _bert(vocab: int, width: int = 64, labels: int = 3, positions: int = 64):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=2 * width, max_position_embeddings=positions, num_labels=labels,
                                  pad_token_id=0)
    return transformers.BertForSequenceClassification(cfg).eval()


def _llama(vocab: int, width: int = 96, positions: int = 64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=2 * width,
                                   max_position_embeddings=positions)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def bert(data):
    return _bert(data.vocab_size)


@pytest.fixture(scope="module")
def llama(data):
    return _llama(data.vocab_size)


def _kw(data):
    return dict(decode=data.tokenizer.decode, pad_id=data.pad_id, eos_id=data.tokenizer.eos_id)


def test_the_wrapper_computes_the_hugging_face_logits(data, bert, llama):
    x, _ = data.batch(4, seed=1)
    assert bool((x == data.pad_id).any())  # padded sentences: the encoder's attention mask matters
    for hf, mask in ((bert, (x != data.pad_id).long()), (llama, None)):
        model = lb.build(hf)
        assert isinstance(model, HFTextModel) and model.depth == 2
        with torch.no_grad():
            theirs, ours = hf(input_ids=x, attention_mask=mask).logits, model(x)
        assert ours.shape == theirs.shape
        assert float((theirs - ours).abs().max()) < 1e-5 * float(theirs.abs().max())
    model = lb.build(llama)
    assert model.token_table == "model.embed_tokens.weight"
    twin = copy.deepcopy(model)  # observe's copies: the wrapped model still runs the wrapper's modules
    assert twin.hf.model is twin.model and twin.model is not model.model


def test_observe_shares_the_gradient_torch_autograd_computes_on_the_hugging_face_model(data, bert, llama):
    x, y = data.batch(3, seed=4)
    labels = torch.tensor([0, 2, 1])
    for hf, target in ((llama, y), (bert, labels)):
        obs = lb.observe(lb.build(hf), x, target)
        hf.zero_grad()
        if hf is llama:
            logits = hf(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     ignore_index=-100)
        else:
            loss = torch.nn.functional.cross_entropy(hf(input_ids=x, attention_mask=(x != 0).long()).logits, labels)
        named = dict(hf.named_parameters())
        want = torch.autograd.grad(loss, [named[n] for n in obs.param_names], allow_unused=True)
        assert obs.param_names == [n for n, p in hf.named_parameters()]  # the same names as the Hugging Face model
        want = [torch.zeros_like(g) if r is None else r for g, r in zip(obs.gradients, want)]
        scale = max(float(r.abs().max()) for r in want)  # (a key bias's gradient is 0 up to rounding)
        for name, got, ref in zip(obs.param_names, obs.gradients, want):
            assert float((got - ref).abs().max()) <= 1e-5 * scale, name


def test_the_span_view_reads_what_the_query_projection_multiplies(data, bert, llama):
    x, _ = data.batch(2, seed=5)
    model = lb.build(llama)
    with torch.no_grad():
        h = llama.model.embed_tokens(x)
        norm0 = llama.model.layers[0].input_layernorm
        assert torch.allclose(model.layer_inputs(0, x), norm0(h), atol=1e-6)
        # rotary positions act after the projection: block 1's input of a token is the same at every position
        assert torch.allclose(model.vocab_inputs(0), norm0(llama.model.embed_tokens.weight), atol=1e-6)
        assert torch.allclose(model.vocab_inputs(7), model.vocab_inputs(0)) and model.position_free
        enc = lb.build(bert)
        states = bert(input_ids=x, attention_mask=(x != 0).long(), output_hidden_states=True).hidden_states
        assert torch.allclose(enc.layer_inputs(1, x), states[1], atol=1e-5)  # post-LN: block 2's input is block 1's output
        emb = bert.bert.embeddings
        want = emb.LayerNorm(emb.word_embeddings.weight + emb.position_embeddings.weight[5]
                             + emb.token_type_embeddings.weight[0])
        assert torch.allclose(enc.vocab_inputs(5), want, atol=1e-5) and not enc.position_free
    assert enc.span_weights(0) == [f"bert.encoder.layer.0.attention.self.{k}.weight" for k in ("query", "key", "value")]


def test_the_packed_extension_equals_the_plain_sequences(data, llama):
    model = lb.build(llama)
    x, _ = data.batch(3, seed=7)
    options = torch.arange(2, 60)
    with torch.no_grad():
        for t in (0, 1, 6):
            got = model.extension_inputs(x[:, :t], options)  # every option behind each prefix, one forward
            plain = torch.stack([model.layer_inputs(1, torch.cat([x[:, :t], o.repeat(3, 1)], dim=1))[:, t]
                                 for o in options[:, None]], dim=1)
            assert model._packs and got.shape == plain.shape == (3, 58, 96)
            assert float((got - plain).abs().max()) < 1e-5 * float(plain.abs().max())


@pytest.mark.parametrize("B", [1, 4])
def test_dager_recovers_a_llama_clients_batch_exactly(data, llama, B):
    x, y = data.batch(B, seed=2 + B)  # B·T ≤ 64 < width 96
    rec = lb.attack("dager", lb.observe(lb.build(llama), x, y))
    s = text_scores(rec.images, x, **_kw(data))
    assert s["token_acc"] == 1.0 and s["exact"] == 1.0 and rec.trace["exact"] == [True] * B
    assert set(rec.trace["candidates"]) == {rec.trace["candidates"][0]}  # one position-free candidate set
    assert unigram_chance(x, data.unigram(), **_kw(data))["exact"] == 0.0


def test_dager_recovers_a_bert_classifiers_sentence_exactly(data, bert):
    x, _ = data.batch(1, seed=6)
    rec = lb.attack("dager", lb.observe(lb.build(bert), x, torch.tensor([2])))
    s = text_scores(rec.images, x, **_kw(data))
    assert s["token_acc"] == 1.0 and s["exact"] == 1.0 and rec.trace["exact"] == [True]


def test_dager_searches_a_bert_batch_and_flags_no_wrong_sentence(data):
    # B > 1 goes to the encoder search through the span view (layer_inputs); on this random-init post-LN BERT
    # block 2's gradient keeps 34–36 directions above its float32 floor for ~55 positions, so the search finds few
    # sentences (measured: 1 of 4) and the spectral rule flags none — what it flags must be right
    model = lb.build(_bert(data.vocab_size, width=96))
    x, _ = data.batch(4, seed=3)
    rec = lb.attack("dager", lb.observe(model, x, torch.tensor([0, 1, 2, 1])), seconds=20.0)
    truth = {tuple(r[r != data.pad_id].tolist()) for r in x}
    got = [tuple(r[r != data.pad_id].tolist()) for r in rec.images]
    assert all(row in truth for row, flagged in zip(got, rec.trace["exact"]) if flagged)


def _other(family: str, vocab: int):
    torch.manual_seed(0)
    if family == "opt":  # learned positions (added before block 1), the Llama layout's names
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=vocab, hidden_size=96, num_hidden_layers=2, num_attention_heads=4, ffn_dim=192,
            max_position_embeddings=64, word_embed_proj_dim=96)).eval()
    if family == "qwen2":  # rotary, grouped keys and values, biased q/k/v
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=192, max_position_embeddings=64)).eval()
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=80, num_labels=3, pad_token_id=0)).eval()


@pytest.mark.parametrize("family,B,free", [("opt", 4, False), ("qwen2", 4, True), ("roberta", 1, False)])
def test_dager_on_other_families_with_the_same_layouts(data, family, B, free):
    model = lb.build(_other(family, data.vocab_size))
    assert model.position_free == free  # probed: rotary positions act after the projection
    x, y = data.batch(B, seed=11)
    rec = lb.attack("dager", lb.observe(model, x, y if model.causal else torch.tensor([1])))
    assert text_scores(rec.images, x, **_kw(data))["exact"] == 1.0 and rec.trace["exact"] == [True] * B


def test_tag_beats_the_unigram_chance_on_a_llama_model(data):
    x, y = data.batch(1, seed=5)
    rec = lb.attack("tag", lb.observe(lb.build(_llama(data.vocab_size, width=48)), x, y), preset="quick")
    chance = unigram_chance(x, data.unigram(), **_kw(data))["rouge1"]
    assert text_scores(rec.images, x, **_kw(data))["rouge1"] > chance + 0.2, chance


def test_lamp_runs_on_both_wrapped_families_and_lowers_the_gradient_distance(data, bert):
    small = _llama(data.vocab_size, width=48)
    x, y = data.batch(1, seed=8)
    for hf, target in ((small, y), (bert, torch.tensor([1]))):
        rec = lb.attack("lamp", lb.observe(lb.build(hf), x, target), iterations=40, every=20, candidates=4,
                        prior_steps=20, lr=0.02)
        loss = rec.trace["loss"]
        assert rec.images.shape == x.shape and int(rec.images.max()) < data.vocab_size
        assert all(v == v for v in loss) and loss[-1] < 0.8 * loss[0], type(hf).__name__


def test_dp_sgd_and_noise_apply_to_a_wrapped_encoder(data, bert):
    x, _ = data.batch(2, seed=1)
    y = torch.tensor([0, 2])
    exact = lb.observe(lb.build(bert), x, y)
    noisy = lb.observe(lb.build(bert), x, y, defense="dpsgd:1,0.5")
    assert all(bool(torch.isfinite(g).all()) for g in noisy.gradients)
    assert any(float((a - b).abs().max()) > 0 for a, b in zip(exact.gradients, noisy.gradients))
    with pytest.raises(NothingRecovered, match="rank above"):
        lb.attack("dager", lb.observe(lb.build(bert), x[:1], y[:1], defense="noise:0.001"))


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_bad_input_to_a_wrapped_model_gives_one_clear_line(data):
    cfg = transformers.BertConfig(vocab_size=data.vocab_size, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    with pytest.raises(ConfigError, match="BertForMaskedLM is not a model.*supported: .*ForCausalLM") as err:
        lb.build(transformers.BertForMaskedLM(cfg))
    _one_line(err)
    lcfg = transformers.LlamaConfig(vocab_size=data.vocab_size, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=8)
    with pytest.raises(ConfigError, match="LlamaForSequenceClassification: sequence classifiers are served for encoders "
                       "with the BERT layout") as err:
        lb.build(transformers.LlamaForSequenceClassification(lcfg))
    _one_line(err)
    x, y = data.batch(1, seed=1)
    with pytest.raises(ConfigError, match="at most 8 tokens .*got 16 .*argument x") as err:  # past max_position_embeddings
        lb.observe(lb.build(transformers.LlamaForCausalLM(lcfg)), x, y)
    _one_line(err)
    small = _llama(500, width=32)
    with pytest.raises(ConfigError, match=r"ids in 0\.\.499 .*tokenizer does not match the model") as err:
        lb.observe(lb.build(small), x, y)
    _one_line(err)
    with pytest.raises(ConfigError, match="500 outputs .*got classes=2000") as err:
        lb.build(small, classes=data.vocab_size)
    _one_line(err)


def test_dager_refuses_a_family_whose_attention_it_cannot_read(data):
    cfg = transformers.GPTNeoXConfig(vocab_size=data.vocab_size, hidden_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=192, max_position_embeddings=32)
    torch.manual_seed(0)
    model = lb.build(transformers.GPTNeoXForCausalLM(cfg).eval())  # wrapped: observe and TAG take it
    x, y = data.batch(1, seed=1)
    obs = lb.observe(model, x, y)
    with pytest.raises(UnsupportedThreatModel, match="GPTNeoXForCausalLM has neither the BERT layout"):
        lb.attack("dager", obs)
