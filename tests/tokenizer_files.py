"""Small tokenizer files trained offline, for tests: nothing is downloaded.

The training text is the Python standard library's ``pydoc_data.topics`` (about 460 KB of
English prose and code), so every machine with Python has it. Each ``train_*`` function writes
its files under ``directory`` and returns their paths; training takes well under a second each.
"""

from __future__ import annotations

from pathlib import Path


def training_text_file(directory: Path) -> Path:
    """The pydoc topics as one UTF-8 text file (written once per directory)."""
    from pydoc_data.topics import topics

    path = directory / "pydoc_topics.txt"
    if not path.exists():
        path.write_text("\n".join(topics[key] for key in sorted(topics)), encoding="utf-8")
    return path


def train_gpt2_bpe(directory: Path, vocab_size: int = 1000) -> tuple[Path, Path]:
    """A byte-level BPE with ``<|endoftext|>``: (vocab.json, merges.txt), GPT-2's file format."""
    from tokenizers import ByteLevelBPETokenizer

    directory.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train(
        [str(training_text_file(directory))],
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    vocab, merges = bpe.save_model(str(directory))
    return Path(vocab), Path(merges)


def train_wordpiece(directory: Path, lowercase: bool, vocab_size: int = 1000) -> Path:
    """A BERT WordPiece ``vocab.txt`` ([PAD], [UNK], [CLS], [SEP], [MASK] first)."""
    from tokenizers import BertWordPieceTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    wordpiece = BertWordPieceTokenizer(lowercase=lowercase)
    wordpiece.train(
        [str(training_text_file(directory))], vocab_size=vocab_size, show_progress=False
    )
    (path,) = wordpiece.save_model(str(directory))
    return Path(path)


def train_sentencepiece(
    directory: Path, model_type: str = "bpe", vocab_size: int = 500, **options
) -> Path:
    """A sentencepiece ``.model`` (byte fallback on, so no text is ever <unk>)."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / f"sp_{model_type}"
    sentencepiece.SentencePieceTrainer.train(
        input=str(training_text_file(directory)),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        minloglevel=2,
        num_threads=2,
        **options,
    )
    return prefix.with_suffix(".model")


def train_tokenizer_json(directory: Path, vocab_size: int = 800) -> Path:
    """A Llama-3-like ``tokenizer.json``: byte-level BPE with BOS/EOS/PAD added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(training_text_file(directory))], trainer)
    # Like Llama-3: the post-processor prepends BOS when special tokens are requested.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))],
    )
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path
