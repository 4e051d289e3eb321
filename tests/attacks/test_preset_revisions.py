"""Preset revisions: a preset whose resolved options change must count a new revision, which sweep keys carry."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from leakbench.attacks import ATTACKS, create, preset_revision

#: (attack, preset) → (revision, digest of its resolved options).  When this test fails because a preset's
#: values changed, bump that attack's ``preset_revisions[preset]`` and record the new revision and digest
#: here: sweep stores key trials by (preset, revision), so old results are not resumed as new ones.
RECORDED = {
    ("instahide-carlini", "default"): (0, "8206e88ae602"),
    ("instahide-carlini", "fast"): (0, "d8d689438c56"),
    ("instahide-carlini", "quick"): (0, "706a2bb27694"),
    ("mixup-adaptive", "default"): (0, "9ceaf4ed5136"),
    ("mixup-adaptive", "fast"): (0, "b358251ac7d2"),
    ("mixup-adaptive", "quick"): (0, "c3f2f4006067"),
    ("soteria-adaptive", "default"): (0, "c6f23ff2a2a2"),
    ("soteria-adaptive", "fast"): (0, "ae03367bda31"),
    ("soteria-adaptive", "quick"): (0, "056edad7c3f7"),
    ("topk-adaptive", "default"): (0, "c6f23ff2a2a2"),
    ("topk-adaptive", "fast"): (0, "ae03367bda31"),
    ("topk-adaptive", "quick"): (0, "056edad7c3f7"),
    ("precode-adaptive", "default"): (0, "c6f23ff2a2a2"),
    ("precode-adaptive", "fast"): (0, "ae03367bda31"),
    ("precode-adaptive", "quick"): (0, "056edad7c3f7"),
    ("ats-adaptive", "default"): (0, "4ef51c33ba2b"),
    ("ats-adaptive", "fast"): (0, "d207e7e834c5"),
    ("ats-adaptive", "quick"): (0, "31e0f9a7ab0b"),
    ("cocktail-party", "default"): (0, "167663713e97"),
    ("cocktail-party", "paper"): (0, "4204d74d1064"),
    ("cocktail-party", "quick"): (0, "8d9f6063e2f5"),
    ("dager", "default"): (1, "11440bc8eaf4"),
    ("dager", "quick"): (1, "11440bc8eaf4"),
    ("dlg", "default"): (0, "38bda84e6b89"),
    ("dlg", "idlg"): (0, "cddfcb2a374e"),
    ("dlg", "quick"): (0, "7f0da74a8cac"),
    ("exclusivity", "default"): (0, "a1b831822535"),
    ("exclusivity", "quick"): (0, "a1b831822535"),
    ("fc-inversion", "default"): (0, "d985b79d8801"),
    ("fc-inversion", "quick"): (0, "d985b79d8801"),
    ("hybrid", "default"): (0, "b913ab07249d"),
    ("loki", "default"): (0, "2d0b3b15db04"),
    ("loki", "quick"): (0, "2d0b3b15db04"),
    ("hybrid", "quick"): (0, "dad5e1b4b820"),
    ("inverting-gradients", "default"): (0, "fa65965d0101"),
    ("inverting-gradients", "fast"): (5, "2b18da2eabfb"),
    ("inverting-gradients", "paper-long"): (0, "348e0f0d56b3"),
    ("inverting-gradients", "quick"): (0, "5b37c24c1da3"),
    ("inverting-gradients", "trained"): (0, "c507c31203a6"),
    ("kkt", "default"): (0, "7bd779622107"),
    ("kkt", "paper"): (0, "1cd5ffdf644f"),
    ("kkt", "quick"): (0, "258811ceb1d2"),
    ("lamp", "default"): (0, "446c0aa5f7f4"),
    ("lamp", "quick"): (0, "28bb60e2bd59"),
    ("gias", "default"): (1, "a49c30ef4f7a"),
    ("gias", "quick"): (1, "e224137914f4"),
    ("gias", "colour"): (2, "d879da1fd966"),
    ("gifd", "default"): (0, "6dd6da524e02"),
    ("gifd", "quick"): (0, "8f71f7560149"),
    ("ggl", "default"): (0, "860c86b8105a"),
    ("ggl", "quick"): (0, "44db12950dc0"),
    ("ggl", "adam"): (0, "2c0e8110acc9"),
    ("gradinversion", "default"): (0, "375a417f2bec"),
    ("gradinversion", "quick"): (0, "a236def9608c"),
    ("liu2024", "default"): (0, "bbccc1b2a002"),
    ("liu2024", "paper"): (0, "cb504b7e2b6d"),
    ("liu2024", "quick"): (0, "90d039691465"),
    ("model-inversion", "default"): (0, "ad0fcb93ab56"),
    ("model-inversion", "quick"): (0, "4703b1dd8717"),
    ("rgap", "default"): (0, "7f2542229c83"),
    ("rgap", "quick"): (0, "7f2542229c83"),
    ("robbing-the-fed", "default"): (0, "df3e24c2dace"),
    ("robbing-the-fed", "quick"): (0, "df3e24c2dace"),
    ("trap-weights", "default"): (0, "eda4dd399502"),
    ("trap-weights", "quick"): (0, "eda4dd399502"),
    ("fishing", "default"): (2, "72ee18e59ec7"),
    ("fishing", "quick"): (2, "087fa793fde8"),
    ("fishing-rounds", "default"): (0, "0dc6992ed4f5"),
    ("fishing-rounds", "quick"): (0, "fc2abe755b69"),
    ("spear", "default"): (7, "9c8ef2551b11"),
    ("spear", "quick"): (7, "365525523d8b"),
    ("spear-features", "default"): (6, "207f25e1e14c"),
    ("spear-features", "quick"): (6, "adce9c171cd4"),
    ("tag", "default"): (0, "ad2d18c9fcc4"),
    ("tag", "quick"): (0, "0fc94cc1ba29"),
    ("tensor-features", "default"): (0, "605added5eee"),
    ("tensor-features", "quick"): (0, "e3157edcf819"),
    ("text-imprint", "default"): (1, "883d41f642a7"),
    ("text-imprint", "quick"): (1, "883d41f642a7"),
    ("univariate", "default"): (0, "7ec421753c92"),
}


#: options added after the presets were recorded, with the value at which they change nothing: left out of
#: the digest at that value, so adding an inert option does not revise every preset.
INERT = {"features": 0.0, "feature_phase": 0.0, "features_from": 2, "features_labels": "all", "features_max_images": 0,
         "local_model": "exact", "group": 0.0, "group_every": 50, "group_from": 0.25, "consensus": 1}


def _digest(name: str, preset: str) -> str:
    options = dataclasses.asdict(create(name, preset=preset).options)
    options = {k: v for k, v in options.items() if not (k in INERT and v == INERT[k])}
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _presets():
    for name in ATTACKS.names():
        for preset in ["default", *sorted(p for p in ATTACKS.get(name).presets if p != "default")]:
            yield name, preset


@pytest.mark.parametrize("name,preset", list(_presets()))
def test_a_changed_preset_counts_a_new_revision(name, preset):
    assert (name, preset) in RECORDED, f"new preset {preset!r} of {name!r}: record it in RECORDED"
    revision, digest = RECORDED[(name, preset)]
    assert preset_revision(name, preset) == revision, (
        f"{name} preset {preset!r} is at revision {preset_revision(name, preset)}; update RECORDED")
    assert _digest(name, preset) == digest, (
        f"the options of {name} preset {preset!r} changed: bump its preset_revisions[{preset!r}] to "
        f"{revision + 1} and record (revision, {_digest(name, preset)!r}) in RECORDED")


def test_recorded_presets_all_exist():
    assert set(RECORDED) == set(_presets())


def test_preset_revision_reads_none_as_default_and_unrevised_as_zero():
    assert preset_revision("inverting-gradients", None) == preset_revision("inverting-gradients", "default") == 0
    assert preset_revision("inverting-gradients", "fast") >= 2
