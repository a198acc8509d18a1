"""The table of keys (tutti.engine.config.spec) is the one owner of what a key takes: every field
of EngineConfig has a row, the reference in docs/configuration.md is rendered from it, and a
misspelt key is answered with the nearest one."""

from dataclasses import fields
from pathlib import Path

import pytest

from tutti.engine.config import reference, spec
from tutti.engine.config.settings import ConfigError, EngineConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_every_field_has_a_row_and_every_row_a_field():
    names = {f.name for f in fields(EngineConfig)} - {"roots", "root_templates", "extra"}
    assert set(spec.KEYS) - {"root"} == names
    assert {k.group for k in spec.KEYS.values()} <= set(spec.GROUPS)


def test_every_rows_example_parses():
    for key in spec.KEYS.values():
        if key.name not in ("root", "share_group", "secret_file"):
            key.parse(key.name, key.example)


def test_the_reference_is_rendered_from_the_table():
    assert DOC.read_text() == reference.render_reference(), (
        "docs/configuration.md differs from the table: python3 -m tutti.engine.config.reference > docs/configuration.md")


@pytest.mark.parametrize("typo, near", [("capacity_byte", "capacity_bytes"), ("chunk_token", "chunk_tokens"),
                                        ("hit_polcy", "hit_policy"), ("rot", "root")])
def test_a_misspelt_key_names_the_nearest_one(typo, near):
    with pytest.raises(ConfigError, match=rf"unknown key\(s\) \['{typo}'\]; '{typo}': did you mean '{near}'\?"):
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", typo: 1})


def test_a_key_far_from_every_known_one_gets_no_guess():
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "zzz": 1})
    assert "did you mean" not in str(exc.value) and "allowed keys are" in str(exc.value)
