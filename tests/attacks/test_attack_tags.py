"""Every attack declares its threat-model needs as tags from the known vocabulary."""
from __future__ import annotations

import pytest

from leakbench.attacks import ATTACKS, THREAT_TAGS, attack_tags
from leakbench.attacks.base import check_tags
from leakbench.errors import ConfigError


@pytest.mark.parametrize("name", ATTACKS.names())
def test_every_attack_declares_known_threat_tags(name):
    tags = attack_tags(name)
    assert tags and set(tags) <= set(THREAT_TAGS), (name, tags)
    assert len(set(tags)) == len(tags)
    # one source of what is shared: a client round (gradient) or the trained model (weights)
    assert ("gradient" in tags) != ("weights" in tags), (name, tags)
    assert "update" not in tags or "gradient" in tags


def test_tags_agree_with_what_the_attacks_are():
    assert "modified-model" in attack_tags("robbing-the-fed") and "bn-stats" in attack_tags("liu2024")
    assert "weights" in attack_tags("kkt") and attack_tags("no-such-attack") == ()


def test_unknown_tags_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="field tags of attack 'mine'"):
        check_tags("mine", ("gradient", "telepathy"))
    with pytest.raises(ConfigError, match="field tags"):
        check_tags("mine", "gradient")
