"""The kernel_options registry: validation, defaults, the internal entries' own
namespace, every config field's key registered, and the guide's table generated."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import flexattn
from flexattn import options
from flexattn.lowering.configs.backward import BackwardConfig
from flexattn.lowering.configs.decode import DecodeConfig
from flexattn.lowering.configs.forward import ForwardConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_config_field_key_is_registered():
    for config in (ForwardConfig, BackwardConfig, DecodeConfig):
        for key in config.option_spellings():
            assert key in options.PUBLIC_KEYS, f"{config.__name__} reads unregistered kernel_options {key!r}"


def test_validate_names_the_key_and_the_expected_kind():
    assert options.validate(None) == {}
    with pytest.raises(ValueError, match=r"unknown kernel_options \['NOT_A_KEY'\]"):
        options.validate({"NOT_A_KEY": 1})
    with pytest.raises(ValueError, match="unknown kernel_options"):
        options.validate({"DEFAULT_MASK": True})  # internal: not the user's to set
    with pytest.raises(TypeError, match="SPLIT_KV must be an int, got 2.5"):
        options.validate({"SPLIT_KV": 2.5})
    with pytest.raises(TypeError, match="PRESCALE_QK must be True or False, got 'yes'"):
        options.validate({"PRESCALE_QK": "yes"})
    with pytest.raises(TypeError, match="kernel_options must be a dict or None, got list"):
        options.validate([("BLOCK_M", 64)])
    assert options.validate({"USE_TMA": None, "BLOCK_M": 64, "PRESCALE_QK": 1}) == {
        "USE_TMA": None, "BLOCK_M": 64, "PRESCALE_QK": 1}


def test_defaults_and_reads():
    assert options.read({"OUTPUT_MAX": True}, "OUTPUT_MAX") is True
    assert options.read({}, "OUTPUT_LOGSUMEXP") is True and options.read({}, "PRESCALE_QK") is False
    assert options.read({}, "BLOCK_M") is None  # chosen per call by the tile tables
    assert options.read({}, "FUSED_MERGE") is False
    assert options.read({}, "REVERSED_Q_TILES", True) is True
    assert options.read({"REVERSED_Q_TILES": False}, "REVERSED_Q_TILES", True) is False
    with pytest.raises(KeyError):
        options.read({}, "NOT_A_KEY")


def test_internal_entries_travel_apart_from_the_users():
    carried = {"BLOCK_M": 32, **options.internal_options(DEFAULT_MASK=True, CODE_VERSION="abc")}
    assert set(carried) == {"BLOCK_M", options.INTERNAL_KEY}
    assert options.read_internal(carried, "DEFAULT_MASK") is True
    assert options.read_internal({}, "DEFAULT_MASK") is False
    with pytest.raises(KeyError):
        options.read_internal(carried, "BLOCK_M")
    with pytest.raises(TypeError):
        options.internal_options(DEFAULT_MASK="yes")


def test_flex_attention_checks_options_against_the_registry():
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match="unknown kernel_options"):
        flexattn.flex_attention(q, q, q, kernel_options={"BLOK_M": 16})
    with pytest.raises(TypeError, match="FORCE_DECODE must be True, False or None"):
        flexattn.flex_attention(q, q, q, kernel_options={"FORCE_DECODE": "no"})


def test_guide_table_is_generated_from_the_registry():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import kernel_options_table
    finally:
        sys.path.pop(0)
    text = kernel_options_table.GUIDE.read_text()
    assert kernel_options_table.render(text) == text, "run python3 scripts/kernel_options_table.py"
    for name in options.PUBLIC_KEYS:
        assert f"| `{name}` |" in text


def test_num_programs_must_be_positive():
    assert options.validate({"NUM_PROGRAMS": 3}) == {"NUM_PROGRAMS": 3}
    with pytest.raises(ValueError, match="NUM_PROGRAMS must be 1 or more, got 0"):
        options.validate({"NUM_PROGRAMS": 0})
    with pytest.raises(TypeError, match="NUM_PROGRAMS"):
        options.validate({"NUM_PROGRAMS": 1.5})
