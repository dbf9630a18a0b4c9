"""SentencePiece tokenizers with Megatron-LM's names and behaviour (``--tokenizer-model FILE``).

Built by ``tokenizers.build_tokenizer``; this module needs only the standard library until a
tokenizer is made, and then the optional ``sentencepiece`` package (no torch)::

    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model="tokenizer.model")

[Note: the three SentencePiece types] They read the same ``.model`` file and differ in what
they add around it (as Megatron-LM's legacy ``_SentencePieceTokenizer``,
``_GPTSentencePieceTokenizer`` and ``_Llama2Tokenizer``, the behaviour every released
Megatron-LM checkpoint and dataset of these types was made with):

=========================  ==============================  ===============================
type                       vocab_size / eod                tokenize(text)
=========================  ==============================  ===============================
GPTSentencePieceTokenizer  the model's pieces / eos id     the model's ids, nothing added
Llama2Tokenizer            the model's pieces / eos id     bos id, then the model's ids
SentencePieceTokenizer     pieces + added specials /       the model's ids, with the
                           the ``<EOD>`` id                specials' text cut out as one id
=========================  ==============================  ===============================

``SentencePieceTokenizer`` registers ``<CLS> <SEP> <EOD> <MASK>``, the model's pad, bos and
eos pieces (``<PAD>``/``<BOS>``/``<EOS>`` when the model has none) and ``--vocab-extra-ids``
``<extra_id_i>`` tokens: a name the model lacks gets the next free id after its pieces. The
text of any of them in the input becomes its id, and ``detokenize`` writes each one back
between single spaces. The launcher pads every ``vocab_size`` the usual way
(``tokenizers.vocab_size_with_padding``).

Megatron-LM's newer megatron-core tokenizers (its HEAD after the legacy ones were removed)
treat all three types as the plain SentencePiece wrapper: no bos for Llama2Tokenizer and no
added specials for SentencePieceTokenizer. GPTSentencePieceTokenizer is the same in both.
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from typing import Sequence

CACHE_KEY_MODULE = "megatron_fsdp.training.sentencepiece_tokenizers"
"""This module's path in dataset cache keys: [Note: pinned dataset cache keys] in tokenizers.py."""

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
INSTALL_HINT = "`pip install sentencepiece` (a small wheel with no torch dependency; scripts/setup_env.sh installs it)"


def sentencepiece_problems(tokenizer_type: str, tokenizer_model: str | None) -> list[str]:
    """Flag problems of a SentencePiece ``--tokenizer-type`` (empty if none), without loading the model."""
    problems = []
    if not tokenizer_model:
        problems.append(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model FILE (a SentencePiece "
                        "tokenizer.model)")
    elif not os.path.isfile(tokenizer_model):
        problems.append(f"--tokenizer-model {tokenizer_model!r}: no such file (a SentencePiece .model file is "
                        "expected)")
    if importlib.util.find_spec("sentencepiece") is None:
        problems.append(f"--tokenizer-type {tokenizer_type} reads its --tokenizer-model with the `sentencepiece` "
                        f"package, which is not installed; install it with {INSTALL_HINT}")
    return problems


def _processor(model_file: str):
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(f"SentencePiece tokenizers need the `sentencepiece` package; install it with "
                          f"{INSTALL_HINT}") from None
    return sentencepiece.SentencePieceProcessor(model_file=model_file)


def _ids(ids: Sequence[int]) -> list[int]:
    """Plain ints (sentencepiece refuses numpy integers and tensors)."""
    return [int(i) for i in ids]


class _SentencePieceBase:
    """The loaded model, its piece <-> id tables and Megatron-LM's identifiers."""

    def __init__(self, model_file: str) -> None:
        self.model_file = model_file
        self.tokenizer = _processor(model_file)
        self._inv_vocab = {i: self.tokenizer.id_to_piece(i) for i in range(len(self.tokenizer))}
        self._vocab = {piece: i for i, piece in self._inv_vocab.items()}
        self._identity = {"tokenizer_model": os.path.abspath(model_file)}

    def _required_id(self, name: str, token_id: int) -> int:
        # A model trained with e.g. --eos_id=-1 has no such piece; Megatron-LM would use -1 as a token.
        if token_id < 0:
            raise ValueError(f"{type(self).__name__} uses the model's {name} piece, but {self.model_file} has none "
                             f"({name}_id={token_id}); train the model with a {name} piece")
        return token_id

    @property
    def unique_identifiers(self) -> OrderedDict:
        # As tokenizers._TokenizerBase's, not inherited (tokenizers.py imports this module),
        # with the module path pinned: [Note: pinned dataset cache keys] in tokenizers.py.
        module = CACHE_KEY_MODULE if type(self).__module__ == __name__ else type(self).__module__
        ident = OrderedDict(cls=f"{module}.{type(self).__qualname__}")
        ident.update(self._identity)
        return ident

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def offsets(self, ids: Sequence[int], text: str) -> list[int]:
        """Character offset of each id's piece in the decoded text."""
        return [p.begin for p in self.tokenizer.decode_ids_as_immutable_proto(_ids(ids)).pieces]


class GPTSentencePieceTokenizer(_SentencePieceBase):
    """The model's pieces as they are: ids without bos/eos, eod = the model's eos."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self.pad = self.tokenizer.pad_id()  # -1 when the model has no pad piece, as in Megatron-LM
        self.bos = self.tokenizer.bos_id()
        self.eos = self._required_id("eos", self.tokenizer.eos_id())

    @property
    def eod(self) -> int:
        return self.eos

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode_ids(_ids(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """As GPTSentencePieceTokenizer, but every text starts with the bos id (Llama-2's completion
    format); no eos is added (preprocess_data's --append-eod adds the eod = eos)."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self._required_id("bos", self.bos)

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Llama2Tokenizer.tokenize takes a str, got {type(text).__name__}")
        return [self.bos] * bos + self.tokenizer.encode_as_ids(text) + [self.eos] * eos


class SentencePieceTokenizer(_SentencePieceBase):
    """The model plus Megatron-LM's special tokens (see [Note: the three SentencePiece types])."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file)
        if vocab_extra_ids < 0:
            raise ValueError(f"--vocab-extra-ids must be >= 0, got {vocab_extra_ids}")
        self._special_tokens: dict[str, int] = {}  # in registration order: ties in tokenize go to the first
        self._inv_special_tokens: dict[int, str] = {}
        self.cls, self.sep, self.eod_id, self.mask = (self._add_special(t) for t in ("<CLS>", "<SEP>", "<EOD>",
                                                                                       "<MASK>"))
        self.pad = self._add_special(self._piece_or(self.tokenizer.pad_id(), "<PAD>"))
        self.bos = self._add_special(self._piece_or(self.tokenizer.bos_id(), "<BOS>"))
        self.eos = self._add_special(self._piece_or(self.tokenizer.eos_id(), "<EOS>"))
        self._extra_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._extra_tokens:
            self._add_special(token)
        self._identity["vocab_extra_ids"] = vocab_extra_ids

    def _piece_or(self, token_id: int, fallback: str) -> str:
        return self.tokenizer.id_to_piece(token_id) if 0 <= token_id < len(self.tokenizer) else fallback

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special_tokens[token] = self._vocab[token]
        self._inv_special_tokens[self._vocab[token]] = token
        return self._vocab[token]

    @property
    def eod(self) -> int:
        return self.eod_id

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[t] for t in self._extra_tokens]

    def _next_special(self, text: str, start: int) -> tuple[int, str] | None:
        """(position, token) of the special token found earliest from ``start``; None if none."""
        best = None
        for token in self._special_tokens:
            pos = text.find(token, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, token)
        return best

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        while (found := self._next_special(text, start)) is not None:
            pos, token = found
            ids += self.tokenizer.encode_as_ids(text[start:pos])
            ids.append(self._special_tokens[token])
            start = pos + len(token)
        return ids + self.tokenizer.encode_as_ids(text[start:])

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = _ids(ids)
        parts, run_start = [], 0
        for i, token_id in enumerate(ids):
            token = self._inv_special_tokens.get(token_id)
            if token is not None:
                parts.append(f"{self.tokenizer.decode_ids(ids[run_start:i])} {token} ")
                run_start = i + 1
        return "".join(parts) + self.tokenizer.decode_ids(ids[run_start:])
