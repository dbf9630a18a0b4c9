#!/usr/bin/env python3
"""Train a small GPT-2 style byte-level BPE vocabulary on a text file.

    python3 scripts/build_bpe_vocab.py --input data/corpus.txt --output-dir data/bpe --num-merges 2000

writes ``vocab.json`` and ``merges.txt`` in GPT-2's formats, readable by
``--tokenizer-type GPT2BPETokenizer --vocab-file .../vocab.json --merge-file .../merges.txt``
(ours, Megatron-LM's and HuggingFace's). The files in ``data/bpe/`` were made by the
command above; ``tests/test_tokenizers.py`` rebuilds them and checks they are unchanged.

Training is the textbook algorithm, deterministic: cut the text into words with GPT-2's
pattern, spell each word in GPT-2's 256 byte characters, then repeatedly merge the most
frequent adjacent pair (ties: the lexicographically smallest pair) until ``--num-merges``
merges exist or no pair occurs ``--min-frequency`` times. Ids: the 256 byte characters in
GPT-2's order, then each merge result, then ``<|endoftext|>`` last, as in GPT-2.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fsdp.training.data.tokenizers import (  # noqa: E402
    END_OF_TEXT,
    byte_alphabet,
    bytes_to_unicode,
    gpt2_pretokenizer,
)


def count_words(text: str) -> collections.Counter:
    """Frequency of each pre-tokenized word, spelled in GPT-2's byte characters."""
    table = bytes_to_unicode()
    words = collections.Counter(gpt2_pretokenizer().findall(text))
    return collections.Counter({"".join(table[b] for b in w.encode("utf-8")): n for w, n in words.items()})


class _PairStats:
    """Weighted counts of adjacent symbol pairs, and which words hold each pair."""

    def __init__(self, words: list[list[str]], freqs: list[int]) -> None:
        self.words, self.freqs = words, freqs
        self.counts: collections.Counter = collections.Counter()
        self.where: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
        for i, symbols in enumerate(words):
            self._add(i, symbols, +1)

    def _add(self, i: int, symbols: list[str], sign: int) -> None:
        for pair in zip(symbols, symbols[1:]):
            self.counts[pair] += sign * self.freqs[i]
            if sign > 0:
                self.where[pair].add(i)

    def best(self) -> tuple[tuple[str, str], int] | None:
        if not self.counts:
            return None
        # Highest count; among equals the smallest pair, so the result never depends on dict order.
        pair = min(self.counts, key=lambda p: (-self.counts[p], p))
        return pair, self.counts[pair]

    def merge(self, pair: tuple[str, str]) -> None:
        joined = pair[0] + pair[1]
        for i in sorted(self.where.pop(pair, ())):
            old = self.words[i]
            new, j = [], 0
            while j < len(old):
                if j + 1 < len(old) and old[j] == pair[0] and old[j + 1] == pair[1]:
                    new.append(joined)
                    j += 2
                else:
                    new.append(old[j])
                    j += 1
            if new == old:
                continue
            self._add(i, old, -1)
            self._add(i, new, +1)
            self.words[i] = new
        for p in [p for p, c in self.counts.items() if c <= 0]:
            del self.counts[p]


def train_bpe(text: str, num_merges: int, min_frequency: int = 2) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE trained on ``text``."""
    counted = sorted(count_words(text).items())
    stats = _PairStats([list(w) for w, _ in counted], [n for _, n in counted])
    vocab = {token: i for i, token in enumerate(byte_alphabet())}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        found = stats.best()
        if found is None or found[1] < min_frequency:
            break
        pair = found[0]
        merges.append(pair)
        vocab.setdefault(pair[0] + pair[1], len(vocab))
        stats.merge(pair)
    vocab[END_OF_TEXT] = len(vocab)
    return vocab, merges


def write_vocab(output_dir: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> tuple[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    vocab_path = os.path.join(output_dir, "vocab.json")
    merge_path = os.path.join(output_dir, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
        f.write("\n")
    with open(merge_path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{a} {b}\n" for a, b in merges)
    return vocab_path, merge_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", default=["data/corpus.txt"], help="Text files to train on.")
    parser.add_argument("--output-dir", default="data/bpe", help="Where vocab.json and merges.txt go.")
    parser.add_argument("--num-merges", type=int, default=2000)
    parser.add_argument("--min-frequency", type=int, default=2, help="Stop when the best pair is rarer than this.")
    args = parser.parse_args(argv)
    text = "\n\n".join(open(path, encoding="utf-8").read() for path in args.input)
    vocab, merges = train_bpe(text, args.num_merges, args.min_frequency)
    vocab_path, merge_path = write_vocab(args.output_dir, vocab, merges)
    print(f"wrote {vocab_path} ({len(vocab)} tokens) and {merge_path} ({len(merges)} merges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
