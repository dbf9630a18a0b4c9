"""Sentence splitting for ``scripts/preprocess_data.py --split-sentences``.

Megatron-LM splits with NLTK's punkt model (``tokenizers/punkt/<lang>.pickle``, found
through ``NLTK_DATA`` or NLTK's search path). Nothing is downloaded here, so punkt is
used when nltk and its data are already installed; otherwise ``--sentence-splitter
auto`` (the default) falls back to ``RuleSentenceSplitter``, a small documented rule set,
and ``--sentence-splitter punkt`` is an error that says how to install the data.

[Note: the rule splitter] A sentence ends at ``.``, ``!`` or ``?`` (a run of them,
then any closing quotes or brackets) that is followed by whitespace and then by
something that does not start with a lowercase letter, or by the end of the text.
A ``.`` does not end a sentence after a known abbreviation (``Mr.``, ``e.g.``,
``etc.``, ... see ``ABBREVIATIONS``) or after a single letter (an initial, ``J. Smith``).
Sentences are stripped of the whitespace between them; with ``keep_newlines`` that
whitespace stays at the end of the sentence before it, so newlines survive (what
Megatron-LM's ``--keep-newlines`` does to punkt). It agrees with punkt on ordinary
prose, not on every corner (punkt learns its abbreviations); token ids differ only
where the two split differently, and the document's ids never change (sentences
only add boundaries in the ``.idx``).

Standard library only: preprocess_data.py loads this file without importing torch.
"""

from __future__ import annotations

import os
import re
from typing import Protocol

SPLITTERS = ("auto", "punkt", "rule")

ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "mt", "vs", "etc", "e.g", "i.e", "cf", "al", "fig", "no",
    "vol", "approx", "inc", "ltd", "co", "corp", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept",
    "oct", "nov", "dec", "u.s", "u.k", "ph.d",
})
"""Words (lowercase, without the final dot) after which a ``.`` does not end a sentence."""

_CLOSERS = "\"')]\u201d\u2019"
_OPENERS = "\"'([\u201c\u2018"
# terminator run + closing quotes/brackets, then the whitespace after it (or the end of the text)
_CANDIDATE = re.compile(r"""[.!?]+["'\u201d\u2019)\]]*(?=\s|$)""")


class SentenceSplitter(Protocol):
    def tokenize(self, text: str) -> list[str]: ...


class SentenceSplitterUnavailable(RuntimeError):
    """NLTK or its punkt data is missing and ``--sentence-splitter punkt`` asked for it."""


class RuleSentenceSplitter:
    """See [Note: the rule splitter]."""

    def __init__(self, keep_newlines: bool = False) -> None:
        self.keep_newlines = keep_newlines

    def tokenize(self, text: str) -> list[str]:
        sentences, start = [], 0
        for match in _CANDIDATE.finditer(text):
            if not self._ends_sentence(text, match):
                continue
            rest = len(text) - len(text[match.end():].lstrip())  # index after the following whitespace
            end = rest if self.keep_newlines else match.end()
            sentences.append(text[start:end])
            start = rest
        if start < len(text):
            sentences.append(text[start:])
        if self.keep_newlines:
            return [s for s in sentences if s.strip()]
        return [s.strip() for s in sentences if s.strip()]

    @staticmethod
    def _ends_sentence(text: str, match: re.Match) -> bool:
        after = text[match.end():].lstrip()
        if after and after[0].islower():
            return False
        if match.group(0).rstrip(_CLOSERS) == ".":  # a single dot: maybe an abbreviation or an initial
            before = text[:match.start()].split()
            word = before[-1].lstrip(_OPENERS).lower() if before else ""
            if word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
                return False
        return True


def punkt_splitter(lang: str = "english", keep_newlines: bool = False) -> SentenceSplitter:
    """NLTK's punkt model for ``lang``, loaded as Megatron-LM loads it (``NLTK_DATA`` first);
    raises ``SentenceSplitterUnavailable`` naming what is missing and how to add it."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise SentenceSplitterUnavailable(
            "--split-sentences with punkt needs the nltk package: `pip install nltk`, then put its punkt data "
            "where NLTK_DATA points (python -m nltk.downloader punkt, on a machine with network), or use "
            "--sentence-splitter rule") from None
    root = os.environ.get("NLTK_DATA")
    library = os.path.join("tokenizers", "punkt", f"{lang}.pickle")
    url = f"file:{os.path.join(root, library)}" if root else f"nltk:{library}"
    try:
        splitter = nltk.load(url)
    except (LookupError, OSError, ValueError) as exc:
        raise SentenceSplitterUnavailable(
            f"NLTK's punkt data for {lang!r} is not installed ({url}; nothing is downloaded here): fetch it with "
            "`python -m nltk.downloader punkt` where there is network and point NLTK_DATA at it, or use "
            f"--sentence-splitter rule ({type(exc).__name__})") from None
    if not keep_newlines:
        return splitter

    class _KeepNewlines(PunktLanguageVars):
        # punkt's period context with \s* instead of \s+ after the sentence end, so the
        # newlines stay with the sentence before them (as Megatron-LM's CustomLanguageVars).
        _period_context_fmt = r"""
            \S*
            %(SentEndChars)s
            \s*
            (?=(?P<after_tok>
                %(NonWord)s
                |
                (?P<next_tok>\S+)
            ))"""

    return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=_KeepNewlines())


def build_sentence_splitter(kind: str, lang: str = "english", keep_newlines: bool = False) -> tuple[SentenceSplitter, str]:
    """(splitter, a line saying which one and why) for ``--sentence-splitter kind``."""
    if kind not in SPLITTERS:
        raise ValueError(f"--sentence-splitter {kind!r} is not one of {', '.join(SPLITTERS)}")
    if kind == "rule":
        return RuleSentenceSplitter(keep_newlines), "splitting sentences with the rule-based splitter"
    try:
        return punkt_splitter(lang, keep_newlines), f"splitting sentences with NLTK punkt ({lang})"
    except SentenceSplitterUnavailable as exc:
        if kind == "punkt":
            raise
        return RuleSentenceSplitter(keep_newlines), (
            f"NLTK punkt is unavailable, so sentences are split by the rule-based splitter "
            f"(megatron_fsdp/training/data/sentences.py); boundaries may differ from Megatron-LM's punkt: {exc}")
