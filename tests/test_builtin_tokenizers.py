"""The built-in ByteTokenizer and NullTokenizer, directly and through the plugin registry."""

from __future__ import annotations

import pytest

from mega.core.plugins.manager import make_plugins
from mega.plugins.tokenizers.byte import ByteTokenizer, ByteTokenizerConfig
from mega.plugins.tokenizers.null import NullTokenizer, NullTokenizerConfig, build_null_tokenizer


@pytest.fixture(scope="module")
def plugins():
    return make_plugins()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "naïve café",
        "日本語のテキスト",
        "emoji 🦙🚀 mix",
        "tab\tnl\ncr\r\x00\x1b\x7f",
    ],
)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text


def test_byte_multibyte_lengths_and_ids():
    tok = ByteTokenizer()
    assert tok.tokenize("A") == [65]
    assert tok.tokenize("é") == [0xC3, 0xA9]
    assert tok.tokenize("日") == [0xE6, 0x97, 0xA5]
    assert tok.tokenize("🦙") == [0xF0, 0x9F, 0xA6, 0x99]


def test_byte_special_ids():
    tok = ByteTokenizer()
    assert (tok.eod, tok.eos, tok.pad, tok.vocab_size) == (256, 256, 257, 258)
    assert tok.pad != tok.eod  # Megatron's GPTDataset requires it
    assert tok.bos is None and tok.cls is None and tok.sep is None and tok.mask is None
    assert tok.unique_identifiers["class"] == "ByteTokenizer"


def test_byte_detokenize_skips_specials_and_replaces_broken_utf8():
    tok = ByteTokenizer()
    ids = tok.tokenize("ab") + [tok.eod] + tok.tokenize("c") + [tok.pad, tok.pad]
    assert tok.detokenize(ids) == "abc"
    # A window cut inside a 4-byte emoji: replacement character, no exception.
    assert tok.detokenize(tok.tokenize("x🦙")[:3]) == "x\ufffd"


def test_null_tokenizer_follows_megatron():
    tok = NullTokenizer(100)
    assert tok.vocab_size == 101
    assert tok.eod == 100 and tok.eos == 100
    assert tok.tokenize("1 2 3") == [1, 2, 3]
    assert tok.tokenize("  4\n5  6 ") == [4, 5, 6]
    assert tok.tokenize("") == []
    assert tok.detokenize([7, 8, 100]) == "7 8 100"
    assert tok.cls is None and tok.sep is None and tok.mask is None and tok.pad is None
    assert tok.unique_identifiers == {"class": "NullTokenizer", "vocab_size": 100}


def test_null_tokenizer_validate():
    assert NullTokenizerConfig().validate() == [
        "--vocab-size is required with --tokenizer-type NullTokenizer"
    ]
    assert NullTokenizerConfig(vocab_size=0).validate() == ["--vocab-size must be positive, got 0"]
    assert NullTokenizerConfig(vocab_size=50).validate() == []
    with pytest.raises(ValueError, match="--vocab-size is required"):
        build_null_tokenizer(NullTokenizerConfig())
    assert build_null_tokenizer(NullTokenizerConfig(vocab_size=50)).vocab_size == 51


def test_tokenizers_registered_through_entry_points(plugins):
    byte_spec = plugins.tokenizers.get("ByteTokenizer")
    assert byte_spec.config_cls is ByteTokenizerConfig
    assert byte_spec.build(ByteTokenizerConfig()).vocab_size == 258
    null_spec = plugins.tokenizers.get("NullTokenizer")
    assert null_spec.build(null_spec.config_cls(vocab_size=31)).eod == 31
