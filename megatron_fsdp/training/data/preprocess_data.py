"""Tokenize text or JSON lines into a Megatron indexed dataset (``.bin`` + ``.idx``).

    megatron-fsdp-preprocess-data --input data/corpus.txt --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/bpe/vocab.json \\
        --merge-file data/bpe/merges.txt --append-eod --workers 1

writes ``data/corpus_text_document.bin`` and ``.idx`` (``{prefix}_{json key}_{document|sentence}``),
which ``--data-path data/corpus_text_document`` reads, here and in Megatron-LM. The flags are
Megatron-LM's ``tools/preprocess_data.py`` flags. Input: JSON lines (one document per line,
text under ``--json-keys``; ``.gz`` too) or plain text, where ``--text-documents`` says what a
document is (``paragraph``: blocks separated by blank lines, the default; ``line``; ``file``).
``--split-sentences`` writes ``{prefix}_{key}_sentence`` with one .idx entry per sentence,
split by NLTK's punkt when nltk and its data are installed, else by the rule-based splitter
(``--sentence-splitter``; see megatron_fsdp/training/data/sentences.py).

The same program runs as ``python3 scripts/preprocess_data.py`` (Megatron-LM's path) and
``python3 -m megatron_fsdp.training.data.preprocess_data``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing
import os
import sys
import time

# Leaf modules only: the package roots load lazily ([Note: lazy package root]), so the
# workers import the reader/writer and the tokenizers without torch.
from megatron_fsdp.training.data import indexed as _indexed
from megatron_fsdp.training.data import sentences as _sentences
from megatron_fsdp.training.data import tokenizers as _tokenizers

IndexedDatasetWriter, bin_path, idx_path, optimal_dtype = (
    _indexed.IndexedDatasetWriter, _indexed.bin_path, _indexed.idx_path, _indexed.optimal_dtype)
TOKENIZER_CHOICES, build_tokenizer = _tokenizers.TOKENIZER_CHOICES, _tokenizers.build_tokenizer

# One tokenizer per worker process, built once by _init_worker.
_worker: dict = {}


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_CHOICES)
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json.")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt.")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a local directory; GPTSentencePieceTokenizer, Llama2Tokenizer, "
                        "SentencePieceTokenizer: a SentencePiece .model file (needs `pip install sentencepiece`).")
    g.add_argument("--vocab-extra-ids", type=int, default=0,
                   help="SentencePieceTokenizer only: add <extra_id_0>..<extra_id_{N-1}> tokens.")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Accepted for Megatron-LM compatibility; the .bin holds unpadded ids.")
    g = parser.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="JSON lines (.json/.jsonl[.gz]) or a text file; a glob for several files.")
    g.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto",
                   help="auto: JSON lines when the name ends in .json/.jsonl(.gz), else text.")
    g.add_argument("--text-documents", choices=("paragraph", "line", "file"), default="paragraph",
                   help="What one document of a text input is.")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="Keys of each JSON line to tokenize.")
    g.add_argument("--split-sentences", action="store_true",
                   help="Split documents into sentences (the .idx records each sentence's length).")
    g.add_argument("--keep-newlines", action="store_true", help="With --split-sentences: keep newlines.")
    g.add_argument("--sentence-splitter", choices=_sentences.SPLITTERS, default="auto",
                   help="This script's own flag: punkt = NLTK's punkt model as Megatron-LM (installed nltk and "
                        "data; nothing is downloaded), rule = the documented rule-based splitter of "
                        "megatron_fsdp/training/data/sentences.py, auto = punkt when available, else rule.")
    g = parser.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="Append the end-of-document token to each document.")
    g.add_argument("--lang", default="english", help="Language of NLTK's sentence splitter.")
    g = parser.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="Output path without the _{key}_{level}.bin/.idx suffix.")
    g = parser.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="Tokenizer processes (over all partitions).")
    g.add_argument("--partitions", type=int, default=1, help="Process the input in this many parts, then merge.")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="With --partitions: give each part a contiguous run of documents, keeping their order.")
    g.add_argument("--log-interval", type=int, default=1000, help="Documents between progress lines.")
    g.add_argument("--find-optimal-num-workers", action="store_true", help="Not supported here.")
    g.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64], help="Not supported here.")
    g.add_argument("--max-documents", type=int, default=100_000, help="Not supported here.")
    args = parser.parse_args(argv)
    if args.find_optimal_num_workers:
        parser.error("--find-optimal-num-workers is not supported here; pass --workers N (N = CPU cores is a "
                     "good start)")
    if args.workers < 1 or args.partitions < 1 or args.workers % args.partitions:
        parser.error(f"--workers {args.workers} must be a positive multiple of --partitions {args.partitions}")
    if args.split_sentences:
        try:
            _, how = _sentences.build_sentence_splitter(args.sentence_splitter, args.lang, args.keep_newlines)
        except _sentences.SentenceSplitterUnavailable as exc:
            parser.error(str(exc))
        print(f"preprocess_data.py: {how}", file=sys.stderr)
    return args


def _tokenizer(args):
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                           vocab_extra_ids=args.vocab_extra_ids)


def _is_jsonl(args, path: str) -> bool:
    if args.input_format != "auto":
        return args.input_format == "jsonl"
    return path.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz"))


def read_documents(args, paths: list[str]):
    """Yield each input document as ``{key: text}``."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            if _is_jsonl(args, path):
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    missing = [k for k in args.json_keys if k not in record]
                    if missing:
                        raise KeyError(f"{path}:{lineno} has no key {missing[0]!r}; its keys are {sorted(record)}; "
                                       "choose --json-keys")
                    yield {k: record[k] for k in args.json_keys}
            else:
                if args.json_keys != ["text"]:
                    raise ValueError("--json-keys applies to JSON lines; a text input is one field, 'text'")
                yield from ({"text": doc} for doc in _text_documents(f.read(), args.text_documents))


def _text_documents(text: str, mode: str) -> list[str]:
    if mode == "file":
        return [text] if text.strip() else []
    if mode == "line":
        return [line for line in text.splitlines() if line.strip()]
    paragraphs, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
    if current:
        paragraphs.append("\n".join(current))
    return paragraphs


def _init_worker(args) -> None:
    _worker["tokenizer"] = _tokenizer(args)
    _worker["args"] = args
    _worker["splitter"] = (_sentences.build_sentence_splitter(args.sentence_splitter, args.lang,
                                                              args.keep_newlines)[0]
                           if args.split_sentences else None)


def encode(document: dict) -> tuple[dict, dict, int]:
    """(ids per key, sentence lengths per key, characters read) of one document."""
    tokenizer, args, splitter = _worker["tokenizer"], _worker["args"], _worker["splitter"]
    ids, lens, size = {}, {}, 0
    for key, text in document.items():
        size += len(text) if isinstance(text, str) else sum(map(len, text))
        sentences = text if isinstance(text, list) else (splitter.tokenize(text) if splitter else [text])
        doc_ids, sentence_lens = [], []
        for sentence in sentences:
            sentence_ids = tokenizer.tokenize(sentence)
            if sentence_ids:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if doc_ids and args.append_eod:
            doc_ids.append(tokenizer.eod)
            sentence_lens[-1] += 1
        ids[key], lens[key] = doc_ids, sentence_lens
    return ids, lens, size


def output_prefix(args, prefix: str, key: str) -> str:
    return f"{prefix}_{key}_{'sentence' if args.split_sentences else 'document'}"


def process_part(args, documents, prefix: str, workers: int) -> int:
    """Tokenize ``documents`` into ``{prefix}_{key}_{level}.bin/.idx``; returns documents written."""
    dtype = optimal_dtype(_tokenizer(args).vocab_size)
    writers = {key: IndexedDatasetWriter(output_prefix(args, prefix, key), dtype=dtype) for key in args.json_keys}
    pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(args,)) if workers > 1 else None
    if pool is None:
        _init_worker(args)
    encoded = pool.imap(encode, documents, 32) if pool else map(encode, documents)
    start, count, chars = time.time(), 0, 0
    try:
        for count, (ids, lens, size) in enumerate(encoded, start=1):
            chars += size
            for key in args.json_keys:
                writers[key].add_document(ids[key], lens[key])
            if count % args.log_interval == 0:
                elapsed = max(time.time() - start, 1e-9)
                print(f"Processed {count} documents ({count / elapsed:.1f} docs/s, "
                      f"{chars / elapsed / 2**20:.2f} MB/s).", file=sys.stderr)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for writer in writers.values():
        writer.finalize()
    return count


def _part(args, index: int, paths: list[str]) -> list[dict]:
    docs = list(read_documents(args, paths))
    if args.keep_sequential_samples:
        size = -(-len(docs) // args.partitions)
        return docs[index * size:(index + 1) * size]
    return docs[index::args.partitions]


def _process_partition(args, index: int, paths: list[str]) -> None:
    process_part(args, _part(args, index, paths), f"{args.output_prefix}_{index}",
                 args.workers // args.partitions)


def main(argv=None) -> int:
    args = get_args(argv)
    paths = sorted(glob.glob(args.input)) or [args.input]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        print(f"preprocess_data.py: error: --input {missing[0]!r}: no such file", file=sys.stderr)
        return 2
    start = time.time()
    if args.partitions == 1:
        count = process_part(args, read_documents(args, paths), args.output_prefix, args.workers)
    else:
        # Parts are tokenized side by side, then concatenated in part order (as Megatron-LM does).
        procs = [multiprocessing.Process(target=_process_partition, args=(args, i, paths))
                 for i in range(args.partitions)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            print("preprocess_data.py: error: a partition failed (see above)", file=sys.stderr)
            return 1
        dtype = optimal_dtype(_tokenizer(args).vocab_size)
        count = 0
        for key in args.json_keys:
            writer = IndexedDatasetWriter(output_prefix(args, args.output_prefix, key), dtype=dtype)
            for i in range(args.partitions):
                part = output_prefix(args, f"{args.output_prefix}_{i}", key)
                writer.add_index(part)
                os.remove(bin_path(part))
                os.remove(idx_path(part))
            writer.finalize()
            count = len(writer.document_indices) - 1
    for key in args.json_keys:
        out = output_prefix(args, args.output_prefix, key)
        print(f"wrote {out}.bin and {out}.idx ({count} documents) in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
