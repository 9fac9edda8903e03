"""An offline, rule-based sentence splitter for ``mega preprocess --split-sentences``.

Megatron-LM uses NLTK's punkt model, which must be downloaded. This splitter needs nothing and
follows punkt's conventions where they matter for the output (which text goes into which sentence):

1. A sentence may end after ``.``, ``!``, ``?`` or ``…`` (a run of them, e.g. ``?!`` or ``...``),
   optionally followed by closing quotes or brackets (``" ' ” ’ ) ]``), when whitespace follows.
2. It does not end there when the next word starts with a lowercase letter (punkt's orthographic
   rule: ``"He said no. and left"`` stays one sentence).
3. After a single ``.`` it does not end when the word before the period is a known abbreviation
   (``Mr. Dr. Prof. St. vs. e.g. i.e. cf. al. Fig. No. Vol. Jan. ... Inc. Ltd. Co.``, see
   ``ABBREVIATIONS``), a single letter (an initial: ``J. R. R. Tolkien``) or a word with an
   inner period (``U.S.``, ``e.g.``, ``a.m.``).
4. CJK full stops ``。！？`` end a sentence with or without whitespace after them.
5. A blank line (two newlines, with only whitespace between) always ends a sentence, so a heading
   or a list item without a final period does not run into the next paragraph. (Punkt does not do
   this; it is the one deliberate difference.)

As with punkt, the first sentence keeps any leading whitespace, the last loses its trailing
whitespace, and empty sentences are never returned. The whitespace between two sentences is
dropped, unless ``keep_newlines`` is set: then it stays at the end of the earlier sentence, as
Megatron's ``--keep-newlines`` punkt variant does, so newlines survive tokenization.
"""

from __future__ import annotations

import re

ABBREVIATIONS = frozenset(
    """
    mr mrs ms mx dr prof sr jr st mt messrs mme mlle rev hon fr gen col maj lt sgt capt cmdr adm
    gov sen rep pres supt insp det vs al cf viz ca approx est dept univ assn inc ltd co corp bros
    fig figs eq eqs no nos vol vols pp ch sec secs art ed eds trans op repr
    jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
    """.split()
)

# (punctuation run)(closing quotes/brackets)(whitespace) | a CJK stop | a blank line
_BOUNDARY = re.compile(
    r"(?P<punct>[.!?\u2026]+)(?P<close>[\"'\u201d\u2019)\]]*)(?P<space>\s+)"
    r"|(?P<cjk>[\u3002\uff01\uff1f]+)(?P<cjkspace>\s*)"
    r"|(?P<para>\n[^\S\n]*\n\s*)"
)
_OPENERS = "\"'\u201c\u2018([{"


def _word_before(text: str, end: int) -> str:
    """The whitespace-delimited word that ends at ``end`` (opening quotes/brackets removed)."""
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:end].lstrip(_OPENERS)


def _is_abbreviation(word: str) -> bool:
    return (
        word.lower() in ABBREVIATIONS
        or (len(word) == 1 and word.isalpha())
        or ("." in word and any(c.isalpha() for c in word))
    )


def _ends_sentence(text: str, match: re.Match) -> bool:
    if match.end() == len(text):
        return False  # only whitespace follows: the last sentence, right-stripped below
    if match.group("cjk") or match.group("para"):
        return True
    space = match.group("space")
    if space.count("\n") >= 2 and re.search(r"\n[^\S\n]*\n", space):
        return True  # a blank line ends the sentence whatever precedes it (rule 5)
    after = match.end()
    if after < len(text) and text[after].islower():
        return False  # rule 2
    if match.group("punct") == "." and _is_abbreviation(_word_before(text, match.start())):
        return False  # rule 3
    return True


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """``text`` cut into sentences by the rules in this module's docstring."""
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if not _ends_sentence(text, match):
            continue
        if keep_newlines:
            end = match.end()
        elif match.group("para"):
            end = match.start()
            while end > start and text[end - 1].isspace():
                end -= 1
        else:
            end = match.start("space") if match.group("punct") else match.start("cjkspace")
        if text[start:end].strip():
            sentences.append(text[start:end])
        start = match.end()
    last = text[start:].rstrip()
    if last.strip():
        sentences.append(last)
    return sentences
