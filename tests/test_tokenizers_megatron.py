"""Megatron's file-based tokenizers: parity with the libraries, special ids, errors, the CLI.

Every tokenizer file is trained here, once per session, on the standard library's pydoc topics
(tests/tokenizer_files.py): nothing is downloaded. Parity is checked against the underlying
library (``tokenizers`` or ``sentencepiece``) loaded from the same files, over odd Unicode.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import sentencepiece
import tokenizers
from tokenizer_files import (
    train_gpt2_bpe,
    train_sentencepiece,
    train_tokenizer_json,
    train_wordpiece,
)

from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError
from mega.plugins.tokenizers.bert_wordpiece import BertWordPieceTokenizer
from mega.plugins.tokenizers.gpt2_bpe import GPT2BPEConfig, GPT2BPETokenizer
from mega.plugins.tokenizers.huggingface import HuggingFaceTokenizer, HuggingFaceTokenizerConfig
from mega.plugins.tokenizers.sentencepiece_tokenizers import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceModelConfig,
    SentencePieceTokenizer,
    SentencePieceTokenizerConfig,
)

from conftest import run_mega

ODD_TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "emoji 🦙🚀 mix 😀😃",
    "family 👨\u200d👩\u200d👧\u200d👦 and 🏳️\u200d🌈 zwj sequences",
    "flags 🇯🇵🇫🇷🇺🇸 skin tones 👍🏻👍🏽👍🏿",
    "日本語のテキストと中文文本，한국어 텍스트",
    "العربية من اليمين إلى اليسار and עברית",
    "combining: e\u0301 a\u0308 n\u0303 \u0065\u0301\u0302 Zalgo z\u0351\u0352\u0353",
    "precomposed café naïve Ångström ÉCOLE",
    "spaces    runs\t\ttabs\n\n\nnewlines \r\n crlf   ",
    "     leading and trailing     ",
    "\t\n \t\n",
    "controls " + "".join(chr(c) for c in range(0x20)) + " del \x7f end",
    "nbsp\u00a0here\u00a0\u00a0and thin\u2009space, ideographic\u3000space",
    "zero width\u200bspace\ufeffbom \u2028line sep",
    "a" * 3000,
    "supercalifragilisticexpialidocious" * 40,
    "def f(x):\n    return x ** 2  # code\n",
    "<|endoftext|> <s> </s> [BOS] <extra_id_0> written as text",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√∞ ① ﬁ ligature",
    "\U0010ffff private \ue000 use",
]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Every tokenizer file the tests use, trained once (about 1 s in all)."""
    root = tmp_path_factory.mktemp("tokenizer_files")
    vocab, merges = train_gpt2_bpe(root / "gpt2")
    return {
        "vocab_json": vocab,
        "merges": merges,
        "vocab_lower": train_wordpiece(root / "wordpiece_lower", lowercase=True),
        "vocab_case": train_wordpiece(root / "wordpiece_case", lowercase=False),
        "sp_bpe": train_sentencepiece(root / "sp"),
        # unigram, with a pad piece defined (id 3) to exercise Megatron's "model has a pad" path
        "sp_unigram": train_sentencepiece(
            root / "sp",
            "unigram",
            input_sentence_size=2000,
            shuffle_input_sentence=False,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
        ),
        "tokenizer_json": train_tokenizer_json(root / "hf"),
    }


def _lines(text: str) -> list[str]:
    return text.splitlines() or [text]


# ------------------------------------------------------------------ GPT-2 BPE


def test_gpt2_bpe_parity_and_round_trip(files):
    ours = GPT2BPETokenizer(str(files["vocab_json"]), str(files["merges"]))
    ref = tokenizers.ByteLevelBPETokenizer(str(files["vocab_json"]), str(files["merges"]))
    expected = [ref.encode(text).ids for text in ODD_TEXTS]
    assert [ours.tokenize(text) for text in ODD_TEXTS] == expected
    assert ours.tokenize_batch(ODD_TEXTS) == expected
    for text, ids in zip(ODD_TEXTS, expected, strict=True):
        assert ours.detokenize(ids) == text  # byte-level BPE is lossless
    # "<|endoftext|>" in the text is plain characters, as in Megatron: never the EOD id
    assert ours.eod not in ours.tokenize("<|endoftext|>")


def test_gpt2_bpe_special_ids(files):
    ours = GPT2BPETokenizer(str(files["vocab_json"]), str(files["merges"]))
    vocab = json.loads(files["vocab_json"].read_text())
    assert ours.vocab_size == len(vocab) == 1000
    assert ours.eod == ours.eos == vocab["<|endoftext|>"] == 0
    assert (ours.bos, ours.pad, ours.cls, ours.sep, ours.mask) == (None,) * 5
    assert ours.additional_special_tokens_ids == []
    assert list(ours.inv_vocab) == sorted(vocab.values())
    assert ours.unique_identifiers["class"] == "GPT2BPETokenizer"
    assert ours.unique_identifiers["vocab_file"]["size"] == files["vocab_json"].stat().st_size
    assert ours.megatron_unique_identifiers == {
        "class": "_GPT2BPETokenizer",
        "tokenizer_path": [str(files["vocab_json"]), str(files["merges"])],
    }


def test_gpt2_bpe_lone_surrogates_become_replacement_characters(files):
    ours = GPT2BPETokenizer(str(files["vocab_json"]), str(files["merges"]))
    ref = tokenizers.ByteLevelBPETokenizer(str(files["vocab_json"]), str(files["merges"]))
    # json.loads gives lone surrogates for "\ud800"; a split pair is joined into its character
    text = json.loads('"lone \\ud800 low \\udfff pair \\ud83d\\ude00 end"')
    assert ours.tokenize(text) == ref.encode("lone \ufffd low \ufffd pair 😀 end").ids
    assert ours.tokenize_batch(["ok", "\ud83d" + "\ude00"]) == [
        ref.encode(t).ids for t in ("ok", "😀")
    ]
    with pytest.raises(TypeError, match="expects str"):
        ours.tokenize_batch(["fine", None])


def test_unique_identifiers_follow_file_content(files, tmp_path):
    vocab = tmp_path / "vocab.json"
    shutil.copy(files["vocab_json"], vocab)
    first = GPT2BPETokenizer(str(vocab), str(files["merges"])).unique_identifiers
    entries = json.loads(vocab.read_text())
    entries["extra-token"] = len(entries)
    vocab.write_text(json.dumps(entries))
    second = GPT2BPETokenizer(str(vocab), str(files["merges"]))
    assert second.unique_identifiers["vocab_file"]["sha256"] != first["vocab_file"]["sha256"]
    assert second.vocab_size == 1001


# ------------------------------------------------------------------ BERT WordPiece


@pytest.mark.parametrize("lower_case", [True, False])
def test_bert_wordpiece_parity(files, lower_case):
    vocab = files["vocab_lower" if lower_case else "vocab_case"]
    ours = BertWordPieceTokenizer(str(vocab), lower_case)
    ref = tokenizers.BertWordPieceTokenizer(str(vocab), lowercase=lower_case)
    expected = [ref.encode(text, add_special_tokens=False).ids for text in ODD_TEXTS]
    assert [ours.tokenize(text) for text in ODD_TEXTS] == expected
    assert ours.tokenize_batch(ODD_TEXTS) == expected
    assert ours.cls not in expected[1] and ours.sep not in expected[1]  # no [CLS]/[SEP] added
    if lower_case:
        assert ours.tokenize("HELLO Café") == ours.tokenize("hello cafe")
    else:
        assert ours.tokenize("HELLO") != ours.tokenize("hello")


def test_bert_wordpiece_special_ids_follow_megatron(files):
    lines = files["vocab_lower"].read_text().splitlines()
    n = len(lines)
    ours = BertWordPieceTokenizer(str(files["vocab_lower"]), True, vocab_extra_ids=3)
    assert (ours.pad, ours.unk, ours.cls, ours.sep, ours.mask) == (0, 1, 2, 3, 4)
    assert [lines[i] for i in (ours.pad, ours.cls, ours.sep, ours.mask)] == [
        "[PAD]", "[CLS]", "[SEP]", "[MASK]",
    ]  # fmt: skip
    # Megatron appends [BOS], [EOS] (eod == eos), then the sentinels
    assert (ours.bos, ours.eos, ours.eod) == (n, n + 1, n + 1)
    assert ours.additional_special_tokens_ids == [n + 2, n + 3, n + 4]
    assert ours.additional_special_tokens == ["<extra_id_0>", "<extra_id_1>", "<extra_id_2>"]
    assert ours.vocab_size == n + 5
    assert list(ours.inv_vocab) == list(range(n + 5))  # id order: BERT masking draws from it
    assert ours.inv_vocab[n + 4] == "<extra_id_2>"
    assert ours.megatron_unique_identifiers == {
        "class": "_BertWordPieceTokenizer",
        "tokenizer_path": [str(files["vocab_lower"])],
        "lower_case": "True",
        "vocab_extra_ids": "3",
    }
    plain = BertWordPieceTokenizer(str(files["vocab_lower"]), True)
    assert plain.vocab_size == n + 2 and plain.additional_special_tokens_ids == []


def test_bert_wordpiece_keeps_bos_eos_already_in_vocab(files, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text(files["vocab_case"].read_text() + "[EOS]\n")
    n = len(vocab.read_text().splitlines())
    ours = BertWordPieceTokenizer(str(vocab), False, vocab_extra_ids=1)
    assert ours.eos == n - 1 and ours.bos == n and ours.additional_special_tokens_ids == [n + 1]
    assert ours.vocab_size == n + 2


def test_bert_wordpiece_detokenize_is_megatrons(files):
    ours = BertWordPieceTokenizer(str(files["vocab_lower"]), True, vocab_extra_ids=1)
    ids = ours.tokenize("Hello, world. It isn't here!")
    assert ours.detokenize(ids) == "hello, world. it isn't here!"
    hello = ours.tokenize("hello")
    text = ours.detokenize([ours.cls, *hello, ours.additional_special_tokens_ids[0], ours.sep])
    assert text == "[CLS] hello <extra_id_0> [SEP]"
    assert ours.detokenize([ours.vocab_size + 5]) == ""  # padded-vocab dummy ids are skipped


# ------------------------------------------------------------------ SentencePiece


@pytest.mark.parametrize("model", ["sp_bpe", "sp_unigram"])
def test_sentencepiece_parity(files, model):
    ref = sentencepiece.SentencePieceProcessor(model_file=str(files[model]))
    expected = [ref.encode(text) for text in ODD_TEXTS]
    gpt = GPTSentencePieceTokenizer(str(files[model]))
    assert [gpt.tokenize(text) for text in ODD_TEXTS] == expected
    assert gpt.tokenize_batch(ODD_TEXTS) == expected
    llama = Llama2Tokenizer(str(files[model]))
    assert llama.tokenize_batch(ODD_TEXTS) == [[ref.bos_id(), *ids] for ids in expected]
    assert [llama.tokenize(t) for t in ODD_TEXTS] == [[ref.bos_id(), *ids] for ids in expected]
    # SentencePieceTokenizer matches its special tokens in the text; elsewhere it is the model
    megatron = SentencePieceTokenizer(str(files[model]), vocab_extra_ids=2)
    plain = [t for t in ODD_TEXTS if not re.search(r"<s>|</s>|<extra_id_|<pad>", t)]
    assert megatron.tokenize_batch(plain) == [ref.encode(t) for t in plain]
    for ids in expected:
        assert gpt.detokenize(ids) == ref.decode(ids)
    assert gpt.detokenize(ref.encode("hello world")) == "hello world"


def test_sentencepiece_tokenizer_special_ids_follow_megatron(files):
    ref = sentencepiece.SentencePieceProcessor(model_file=str(files["sp_bpe"]))
    v = ref.get_piece_size()
    assert (v, ref.pad_id(), ref.bos_id(), ref.eos_id()) == (500, -1, 1, 2)
    ours = SentencePieceTokenizer(str(files["sp_bpe"]), vocab_extra_ids=3)
    # <CLS> <SEP> <EOD> <MASK> are new; no pad piece, so <PAD>; <s> and </s> are the model's
    assert (ours.cls, ours.sep, ours.eod, ours.mask, ours.pad) == (v, v + 1, v + 2, v + 3, v + 4)
    assert (ours.bos, ours.eos) == (1, 2)
    assert ours.additional_special_tokens_ids == [v + 5, v + 6, v + 7]
    assert ours.vocab_size == v + 8
    assert ours.megatron_unique_identifiers["vocab_extra_ids"] == "3"

    unigram = SentencePieceTokenizer(str(files["sp_unigram"]))
    u = sentencepiece.SentencePieceProcessor(model_file=str(files["sp_unigram"]))
    assert u.pad_id() == 3 and unigram.pad == 3  # the model's own <pad> piece
    assert unigram.vocab_size == u.get_piece_size() + 4  # only <CLS> <SEP> <EOD> <MASK> added


def test_sentencepiece_tokenizer_splits_at_special_tokens_as_megatron(files):
    ref = sentencepiece.SentencePieceProcessor(model_file=str(files["sp_bpe"]))
    ours = SentencePieceTokenizer(str(files["sp_bpe"]), vocab_extra_ids=11)
    extra = ours.additional_special_tokens_ids
    text = "first part<MASK>second <extra_id_10>x<extra_id_1></s>"
    # Megatron (after NeMo): each piece between special tokens is encoded on its own
    expected = [
        *ref.encode("first part"), ours.mask, *ref.encode("second "), extra[10],
        *ref.encode("x"), extra[1], ours.eos,
    ]  # fmt: skip
    assert ours.tokenize(text) == expected
    assert ours.tokenize_batch(["plain", text, "<CLS>"]) == [
        ref.encode("plain"),
        expected,
        [ours.cls],
    ]
    assert (
        ours.detokenize(expected) == "first part <MASK> second <extra_id_10> x <extra_id_1>  </s> "
    )


def test_gpt_sentencepiece_and_llama2_special_ids(files):
    for cls in (GPTSentencePieceTokenizer, Llama2Tokenizer):
        bpe = cls(str(files["sp_bpe"]))
        assert (bpe.vocab_size, bpe.bos, bpe.eos, bpe.eod, bpe.pad) == (500, 1, 2, 2, None)
        assert (bpe.cls, bpe.sep, bpe.mask) == (None, None, None)
        assert bpe.additional_special_tokens_ids == []
        assert cls(str(files["sp_unigram"])).pad == 3
    llama = Llama2Tokenizer(str(files["sp_bpe"]))
    assert llama.tokenize("") == [1]
    assert llama.detokenize(llama.tokenize("hello world")) == "hello world"
    assert llama.megatron_unique_identifiers["class"] == "_Llama2Tokenizer"


def test_sentencepiece_lone_surrogate(files):
    ref = sentencepiece.SentencePieceProcessor(model_file=str(files["sp_bpe"]))
    gpt = GPTSentencePieceTokenizer(str(files["sp_bpe"]))
    assert gpt.tokenize("a \ud800 b") == ref.encode("a \ufffd b")


# ------------------------------------------------------------------ Hugging Face tokenizer.json


def test_huggingface_parity_and_special_ids(files):
    path = files["tokenizer_json"]
    ref = tokenizers.Tokenizer.from_file(str(path))
    for source in (path, path.parent):  # the file, or its directory
        ours = HuggingFaceTokenizer(str(source))
        expected = [ref.encode(t, add_special_tokens=False).ids for t in ODD_TEXTS]
        assert [ours.tokenize(t) for t in ODD_TEXTS] == expected
        assert ours.tokenize_batch(ODD_TEXTS) == expected
        for text, ids in zip(ODD_TEXTS, expected, strict=True):
            assert ours.detokenize(ids) == text  # this tokenizer.json is byte-level
    assert (ours.bos, ours.eos, ours.eod, ours.pad) == (0, 1, 1, 2)
    assert (ours.cls, ours.sep, ours.mask) == (None, None, None)
    assert ours.vocab_size == ref.get_vocab_size() == 800
    assert ours.tokenize("x<|end_of_text|>") == ref.encode("x<|end_of_text|>").ids[1:]
    with_bos = HuggingFaceTokenizer(str(path), add_special_tokens=True)
    assert with_bos.tokenize_batch(ODD_TEXTS[:3]) == [ref.encode(t).ids for t in ODD_TEXTS[:3]]
    assert with_bos.tokenize("hi")[0] == with_bos.bos


def test_huggingface_side_files_name_the_special_tokens(files, tmp_path):
    shutil.copy(files["tokenizer_json"], tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|pad|>"}, "pad_token": None, "bos_token": "<s>"})
    )
    ours = HuggingFaceTokenizer(str(tmp_path))
    assert ours.eos == ours.eod == 2  # declared eos wins over the guessed <|end_of_text|>
    assert ours.pad is None  # declared null: no guessing
    assert ours.bos is None  # declared, but not in the vocabulary
    assert "tokenizer_config.json" in ours.unique_identifiers
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    assert HuggingFaceTokenizer(str(tmp_path)).eos == 1  # special_tokens_map.json wins


def test_huggingface_t5_sentinels_are_found(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "<extra_id_0>": 4, "<extra_id_1>": 5}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    ours = HuggingFaceTokenizer(str(tmp_path))
    assert ours.additional_special_tokens_ids == [4, 5]
    assert (ours.pad, ours.eos, ours.unk, ours.bos) == (0, 1, 2, None)


# ------------------------------------------------------------------ through the plugin system


def test_every_tokenizer_builds_through_the_plugin_registry(files):
    registry = make_plugins().tokenizers
    cases = {
        "GPT2BPETokenizer": dict(
            vocab_file=str(files["vocab_json"]), merge_file=str(files["merges"])
        ),
        "BertWordPieceLowerCase": dict(vocab_file=str(files["vocab_lower"]), vocab_extra_ids=2),
        "BertWordPieceCase": dict(vocab_file=str(files["vocab_case"])),
        "SentencePieceTokenizer": dict(tokenizer_model=str(files["sp_bpe"]), vocab_extra_ids=2),
        "GPTSentencePieceTokenizer": dict(tokenizer_model=str(files["sp_bpe"])),
        "Llama2Tokenizer": dict(tokenizer_model=str(files["sp_unigram"])),
        "HuggingFaceTokenizer": dict(tokenizer_model=str(files["tokenizer_json"])),
    }
    for name, options in cases.items():
        spec = registry.get(name)
        tok = spec.build(spec.config_cls(**options))
        assert tok.unique_identifiers["class"] == name
        assert isinstance(tok.vocab_size, int) and isinstance(tok.eod, int)
        ids = tok.tokenize_batch(["hello world", ""])
        assert ids[0] == tok.tokenize("hello world") and len(ids) == 2
        assert all(0 <= i < tok.vocab_size for i in ids[0])
        assert "hello" in tok.detokenize(ids[0]).lower()
    lower = registry.get("BertWordPieceLowerCase")
    case = registry.get("BertWordPieceCase")
    text = "Hello"
    lower_ids = lower.build(lower.config_cls(vocab_file=str(files["vocab_case"]))).tokenize(text)
    case_ids = case.build(case.config_cls(vocab_file=str(files["vocab_case"]))).tokenize(text)
    assert lower_ids != case_ids


# ------------------------------------------------------------------ errors


def _one_line(exc: pytest.ExceptionInfo) -> str:
    messages = exc.value.messages
    assert len(messages) == 1 and "\n" not in messages[0], messages
    return messages[0]


def test_missing_and_corrupt_files_are_one_line_usage_errors(files, tmp_path):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\xff\xfe not a tokenizer")
    text = tmp_path / "text.txt"
    text.write_text("just some words\n")
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nzq xj\n")  # tokens the vocab does not have
    missing = str(tmp_path / "missing.file")
    vocab, merges = str(files["vocab_json"]), str(files["merges"])
    cases = [
        (lambda: GPT2BPETokenizer(missing, merges), "--vocab-file", missing, "No such file"),
        (lambda: GPT2BPETokenizer(vocab, missing), "--merge-file", missing, "No such file"),
        (lambda: GPT2BPETokenizer(merges, merges), "--vocab-file", merges, "not JSON"),
        (lambda: GPT2BPETokenizer(str(garbage), merges), "--vocab-file", str(garbage), "UTF-8"),
        (lambda: GPT2BPETokenizer(vocab, vocab), "--merge-file", vocab, "Merges"),
        (lambda: GPT2BPETokenizer(vocab, str(text)), "--merge-file", str(text), "invalid at line 1"),
        (lambda: GPT2BPETokenizer(vocab, str(bad_merges)), "--merge-file", str(bad_merges), f"out of vocabulary of --vocab-file {vocab}"),
        (lambda: GPT2BPETokenizer(str(tmp_path), merges), "--vocab-file", str(tmp_path), "directory"),
        (lambda: BertWordPieceTokenizer(missing, True), "--vocab-file", missing, "No such file"),
        (lambda: BertWordPieceTokenizer(str(text), True), "--vocab-file", str(text), "[CLS]"),
        (lambda: BertWordPieceTokenizer(str(garbage), True), "--vocab-file", str(garbage), "UTF-8"),
        (lambda: SentencePieceTokenizer(missing), "--tokenizer-model", missing, "No such file"),
        (lambda: Llama2Tokenizer(str(text)), "--tokenizer-model", str(text), "sentencepiece"),
        (lambda: GPTSentencePieceTokenizer(vocab), "--tokenizer-model", vocab, "sentencepiece"),
        (lambda: HuggingFaceTokenizer(missing), "--tokenizer-model", missing, "never downloads"),
        (lambda: HuggingFaceTokenizer(vocab), "--tokenizer-model", vocab, "tokenizer.json"),
        (lambda: HuggingFaceTokenizer(str(tmp_path)), "--tokenizer-model", str(tmp_path), "no tokenizer.json"),
    ]  # fmt: skip
    for build, flag, path, reason in cases:
        with pytest.raises(MegaUsageError) as exc:
            build()
        line = _one_line(exc)
        assert line.startswith(f"{flag} {path}: cannot load ("), line
        assert reason in line, line
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({k: v for k, v in json.loads(files["vocab_json"].read_text()).items() if k != "<|endoftext|>"}))  # fmt: skip
    with pytest.raises(MegaUsageError) as exc:
        GPT2BPETokenizer(str(no_eod), merges)
    assert "<|endoftext|>" in _one_line(exc)


def test_validate_names_missing_flags(files, tmp_path):
    assert GPT2BPEConfig().validate() == [
        "--vocab-file is required with --tokenizer-type GPT2BPETokenizer",
        "--merge-file is required with --tokenizer-type GPT2BPETokenizer",
    ]
    registry = make_plugins().tokenizers
    for name, flag in [
        ("BertWordPieceLowerCase", "--vocab-file"),
        ("BertWordPieceCase", "--vocab-file"),
        ("SentencePieceTokenizer", "--tokenizer-model"),
        ("GPTSentencePieceTokenizer", "--tokenizer-model"),
        ("Llama2Tokenizer", "--tokenizer-model"),
        ("HuggingFaceTokenizer", "--tokenizer-model"),
    ]:
        spec = registry.get(name)
        assert spec.config_cls().validate() == [f"{flag} is required with --tokenizer-type {name}"]
        with pytest.raises(MegaUsageError, match=f"{flag} is required"):
            spec.build(spec.config_cls())
    missing = str(tmp_path / "nope.model")
    assert SentencePieceTokenizerConfig(tokenizer_model=missing, vocab_extra_ids=-1).validate() == [
        f"--tokenizer-model {missing}: cannot load (No such file or directory)",
        "--vocab-extra-ids must be 0 or more, got -1",
    ]
    assert SentencePieceModelConfig(tokenizer_model=str(files["sp_bpe"])).validate() == []
    assert not hasattr(SentencePieceModelConfig(), "vocab_extra_ids")  # Megatron fixes it at 0
    assert HuggingFaceTokenizerConfig(tokenizer_model=str(files["tokenizer_json"])).validate() == []


# ------------------------------------------------------------------ the CLI


def test_mega_train_with_gpt2_bpe_pads_the_vocab(files, tmp_path):
    args = [
        "train", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(files["vocab_json"]), "--merge-file", str(files["merges"]),
        "--mock-data", "--train-iters", "2", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--eval-iters", "0",
    ]  # fmt: skip
    result = run_mega(args, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(
        r"padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)", result.stdout
    )
    assert found, result.stdout
    size, dummies, padded = map(int, found.groups())
    assert (size, dummies, padded) == (1000, 24, 1024)
    assert padded % 128 == 0 and padded == size + dummies


def test_mega_train_reports_a_missing_vocab_file(files, tmp_path):
    missing = str(tmp_path / "nope.json")
    args = [
        "train", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", missing,
        "--merge-file", str(files["merges"]), "--mock-data", "--train-iters", "1",
    ]  # fmt: skip
    result = run_mega(args, tmp_path)
    assert result.returncode == 2
    assert f"--vocab-file {missing}: cannot load (No such file or directory)" in result.stderr
