"""datatrove pipeline steps scripts/curate_data.py adds where datatrove has no block for Chinese and English alike.

- MixedScriptTokenizer: a datatrove WordTokenizer whose tokens are Latin/Cyrillic/... words (split at whitespace and
  punctuation) and single CJK characters (Han, kana), so MinHash shingles, Gopher's n-gram repetition and the
  decontamination n-grams count characters in Chinese text and words elsewhere (datatrove's own tokenizers split one
  language each; its default English one would read a whole Chinese sentence as one word).
- CharRatioFilter: length and character-ratio rules that need no word split (Gopher's word-based quality filter asks
  for English stop words and word lengths, which drop every Chinese document).
- TokenSample: the trainer tokenizer's token count of a stated sample of documents (the report's token columns).
- Tally: counts documents and characters passing a point of the pipeline, and the token sample's figures there.
- EvalFilesIndexer: datatrove's n-gram decontamination index built from local JSONL files, one index per file
  (datatrove's own indexer loads lighteval tasks from the Hub).
"""
import array
import contextlib
import os
import re
import zlib
from collections import Counter

import numpy as np
import orjson
from datatrove.data import Document, DocumentsPipeline
from datatrove.io import get_datafolder
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.decont import NGramsDecontFilter, NGramsDecontIndexer
from datatrove.pipeline.dedup import MinhashDedupSignature
from datatrove.pipeline.dedup.exact_dedup import ExactDedupFilter, ExactDedupSignature, get_sig_dtype
from datatrove.pipeline.filters import GopherRepetitionFilter
from datatrove.pipeline.filters.base_filter import BaseFilter, get_filter_result
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import create_hash_func
from datatrove.utils.text import split_into_words
from datatrove.utils.tokenization import PipelineStepWithTokenizer
from datatrove.utils.typeshelper import ExtensionHelperSD, StatHints
from datatrove.utils.word_tokenizers import WordTokenizer, load_word_tokenizer

from scripts.curate.fast import (
    BatchNgrams,
    char_classes,
    class_table,
    mark_table,
    simplify_text,
    top_repeated,
    word_ids,
)
from scripts.curate.minhash import shingle_hashes, signatures
from scripts.curate.rows import WithoutDocStats, parsed_line

# Han (basic, extension A, compatibility), Hiragana, Katakana and CJK symbols: scripts written without spaces
CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
TOKEN = re.compile(rf"[{CJK_RANGES}]|[^\s{CJK_RANGES}]+")
CJK = re.compile(rf"[{CJK_RANGES}]")
SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s*")
SAMPLE_CHARS = 100_000  # TokenSample tokenizes at most this much of a document: memory bounded by it, not the document


class MixedScriptTokenizer(WordTokenizer):
    """Words where words are spaced, one token per character in CJK text."""

    def __init__(self):
        super().__init__("mixed")

    def word_tokenize(self, text: str) -> list[str]:
        if CJK.search(text) is None:  # no CJK: the runs between whitespace (re's \s is str.isspace, split's)
            return text.split()
        return TOKEN.findall(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [s for s in SENTENCE_END.split(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        spans, start = [], 0
        for sentence in self.sent_tokenize(text):
            start = text.index(sentence, start)
            spans.append((start, start + len(sentence)))
            start += len(sentence)
        return spans


class BatchedFilter(WithoutDocStats, BaseFilter):
    """BaseFilter whose filter_batch gets batches of at most BATCH_CHARS characters (BaseFilter's count documents,
    whatever their size), its per-document statistics summed once a batch (datatrove's stat_update costs ~10 us a
    call): the same documents kept, the same exclusion files, the same totals in stats.json."""

    BATCH_CHARS, BATCH_DOCS = 30_000, 1_024  # a batch's arrays stay a few MB (1,000,000 characters: +200 MB a run)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with self.exclusion_writer if self.exclusion_writer else contextlib.nullcontext() as writer:
            for batch in self.batches(data):
                with self.track_time():
                    results = self.filter_batch(batch)
                dropped = Counter()
                for doc, result in zip(batch, results):
                    keep, reason = get_filter_result(result)
                    if keep:
                        yield doc
                        continue
                    dropped[reason] += 1
                    if writer:
                        if reason:
                            doc.metadata["filter_reason"] = reason
                        writer.write(doc, rank)
                self.stat_update(StatHints.total, value=len(batch))
                self.stat_update(StatHints.forwarded, value=len(batch) - sum(dropped.values()))
                self.stat_update(StatHints.dropped, value=sum(dropped.values()))
                for reason, count in dropped.items():
                    if reason:
                        self.stat_update(f"dropped_{reason}", value=count)

    def batches(self, data):
        """Lists of consecutive documents of at most BATCH_DOCS documents and, but for their last, BATCH_CHARS
        characters."""
        batch, chars = [], 0
        for doc in data:
            batch.append(doc)
            chars += len(doc.text)
            if chars >= self.BATCH_CHARS or len(batch) >= self.BATCH_DOCS:
                yield batch
                batch, chars = [], 0
        if batch:
            yield batch


class CharRatioFilter(BatchedFilter):
    """Drops documents outside [min_chars, max_chars] characters, with fewer than min_alnum_ratio letters and digits
    among their non-space characters, or more than max_symbol_ratio symbols (Unicode category S outside ASCII: emoji,
    currency signs, arrows, box drawing; ASCII's | < > = + $ are tables, HTML and code); every rule counts characters,
    so it reads Chinese as it reads English."""

    name = "char ratios"

    def __init__(self, min_chars=20, max_chars=1_000_000, min_alnum_ratio=0.6, max_symbol_ratio=0.1,
                 exclusion_writer=None):
        super().__init__(exclusion_writer)
        class_table()  # built here, in the run: every worker forked for the stage has it
        self.min_chars, self.max_chars = min_chars, max_chars
        self.min_alnum_ratio, self.max_symbol_ratio = min_alnum_ratio, max_symbol_ratio

    def filter(self, doc: Document):
        length = len(doc.text)
        if length < self.min_chars:
            return False, "too_short"
        if length > self.max_chars:
            return False, "too_long"
        visible, alnum, symbols = char_classes(doc.text)
        if alnum < self.min_alnum_ratio * visible:
            return False, "few_letters"
        if symbols > self.max_symbol_ratio * visible:
            return False, "symbols"
        return True


def words_in(text):
    """Words of `text` (tokens holding a letter or digit; one per CJK character): a lone ':' or '-' is none."""
    return sum(1 for token in TOKEN.findall(text) if any(ch.isalnum() for ch in token))


def substantial_duplicates(parts, short_words):
    """datatrove's find_duplicates(parts) (parts seen before, their characters) leaving out parts of at most
    `short_words` words: a speaker's name, a list marker or a closing brace repeats in good text."""
    seen, short, count, chars = set(), {}, 0, 0
    for part in parts:
        if part not in seen:
            seen.add(part)
            continue
        if part not in short:
            short[part] = words_in(part) <= short_words
        if not short[part]:
            count, chars = count + 1, chars + len(part)
    return count, chars


class RepetitionFilter(BatchedFilter, GopherRepetitionFilter):
    """Gopher's repetition rules (datatrove's filter), except that a duplicate line or paragraph of at most
    short_words words (a play's speaker name, a list marker) is not counted as duplicated text, and the top n-gram
    rule counts only an n-gram that occurs twice or more, by the characters it covers (Gopher's rule reads a short
    document's one-off n-gram as repetition; it ran after a 50-word minimum). A batch of documents at a time."""

    name = "repetition"

    def __init__(self, top_n_grams=((2, 0.2), (3, 0.18), (4, 0.16)), short_words=3, **kwargs):
        super().__init__(top_n_grams=(), **kwargs)
        self.repeated_top_n_grams, self.short_words = top_n_grams, short_words

    def filter(self, doc: Document):
        """One document's verdict (filter_batch's, for a batch of one)."""
        return self.filter_batch([doc])[0]

    def filter_batch(self, batch):
        """GopherRepetitionFilter.filter of each document with short lines and paragraphs left out of the
        duplicates, its duplicated n-gram count by fast.BatchNgrams (same result), then the repeated top n-gram rule."""
        results = [self.line_rules(doc.text) for doc in batch]
        pending = [i for i, result in enumerate(results) if result is True]
        words = [split_into_words(batch[i].text, self.language) for i in pending]
        grams = BatchNgrams(words)
        duplicated = grams.duplicated_chars([n for n, _ in self.dup_n_grams])
        duplicated = {n: chars.tolist() for n, chars in duplicated.items()}
        bounds = {n: grams.top_repeated_chars_at_most(n).tolist() for n, _ in self.repeated_top_n_grams}
        for k, i in enumerate(pending):
            results[i] = self.ngram_rules(batch[i].text, words[k], {n: chars[k] for n, chars in duplicated.items()},
                                          {n: bound[k] for n, bound in bounds.items()})
        return results

    def line_rules(self, text):
        """Gopher's duplicate paragraph and line rules (short ones left out): True, or (False, reason)."""
        if not text:
            return False, "empty"
        for parts, frac, char_frac, label in ((self.paragraph_exp.split(text.strip()), self.dup_para_frac,
                                               self.dup_para_char_frac, "para"),
                                              (self._line_splitter.split(text), self.dup_line_frac,
                                               self.dup_line_char_frac, "line")):
            duplicates, duplicate_chars = substantial_duplicates(parts, self.short_words)
            if frac and duplicates / len(parts) > frac:
                return False, f"dup_{label}_frac"
            if char_frac and duplicate_chars / len(text) > char_frac:
                return False, f"dup_{label}_char_frac"
        return True

    def ngram_rules(self, text, words, duplicated, bounds):
        """Gopher's duplicated n-gram rules, then the repeated top n-gram rule: True, or (False, reason)."""
        for n, fraction in self.dup_n_grams:
            if duplicated[n] / len(text) > fraction:
                return False, f"duplicated_{n}_n_grams"
        ids = None
        for n, fraction in self.repeated_top_n_grams:
            if bounds[n] <= fraction * len(text):
                continue  # no n-gram can break the rule
            ids = word_ids(words) if ids is None else ids
            top = top_repeated(words, n, ids)
            if top and top[1] > 1 and top[1] * sum(map(len, top[0])) > fraction * len(text):
                return False, f"top_{n}_gram"
        return True


class FastMinhashSignature(MinhashDedupSignature):
    """datatrove's MinHash signature step, a batch of documents at a time (minhash.py: the shingles' SHA-1 and the
    permutations in numpy; simplify_text by fast.py): the same signature files, sorted as datatrove sorts them."""

    BATCH_WORDS = 32_768  # words of the documents signed together: their arrays take a few MB

    def __init__(self, output_folder, config, language):
        super().__init__(output_folder, config, language)
        mark_table()  # built here, in the run: every worker forked for the stage has it

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1):
        hashing = self.config.hash_config
        if hashing.hash_fc != "sha1" or hashing.precision != 64 or not isinstance(self.word_tokenizer,
                                                                                  MixedScriptTokenizer):
            return super().run(data, rank, world_size)
        with self.track_time():
            files = [self.output_folder.open(f"bucket_{bi:03d}/{rank:05d}.minhash.sig", mode="wb")
                     for bi in range(self.config.num_buckets)]
            first, spaced, sizes, words = 0, [], [], 0
            for doc in data:
                text, size = self.spaced_words(doc.text)
                spaced.append(text)
                sizes.append(size)
                words += size
                if words >= self.BATCH_WORDS:
                    first, spaced, sizes, words = self.write_batch(files, spaced, sizes, first), [], [], 0
            first = self.write_batch(files, spaced, sizes, first)
            for file in files:
                file.close()
            self.stat_update(StatHints.total, value=first)
            for bi in range(self.config.num_buckets):
                sort_signature_file(self.output_folder, f"bucket_{bi:03d}/{rank:05d}.minhash.sig", self.record_dtype())

    def spaced_words(self, text):
        """(the words of the simplified text joined by single spaces, how many): what the shingles are cut from."""
        simple = simplify_text(text, self.config.norm_config)
        if text.isascii() and self.config.norm_config.norm_whitespace:  # its last step left one space between words
            return simple, simple.count(" ") + 1 if simple else 0
        words = self.word_tokenizer.word_tokenize(simple)
        return " ".join(words), len(words)

    def record_dtype(self):
        """datatrove's record of one bucket: its hashes, then the document's index (uint32), packed."""
        return np.dtype([(f"field{i + 1}", "<u8") for i in range(self.config.hashes_per_bucket)]
                        + [(f"field{self.config.hashes_per_bucket + 1}", "<u4")])

    def write_batch(self, files, spaced, sizes, first):
        """Append the signatures of a batch of documents (first, first + 1, ...: their words joined by spaces, and
        how many; one without shingles has none) to the bucket files; return the next document's index."""
        if not sizes:
            return first
        hashes, counts = shingle_hashes(spaced, sizes, self.config.n_grams)
        a, b = self.parameters
        signed = signatures(hashes, counts, a, b)[counts > 0]
        records = np.empty(len(signed), dtype=self.record_dtype())
        records[records.dtype.names[-1]] = first + np.flatnonzero(counts > 0)
        per_bucket = self.config.hashes_per_bucket
        for bi, file in enumerate(files):
            for i in range(per_bucket):
                records[f"field{i + 1}"] = signed[:, bi * per_bucket + i]
            file.write(records.tobytes())
        return first + len(sizes)


def sort_signature_file(folder, path, dtype):
    """Sort one bucket file's records by (hashes, document), as MinhashDedupSignature does before stage 2 reads it."""
    buffer = bytearray(folder.size(path))
    with folder.open(path, mode="rb") as f:
        f.readinto(buffer)
    records = np.frombuffer(buffer, dtype=dtype)
    records.sort(order=dtype.names)
    with folder.open(path, mode="wb") as f:
        f.write(records.tobytes())


class TokenSample(PipelineStepWithTokenizer):
    """Tokenizes 1 in `every` documents (chosen by a CRC-32 of the document's id, so a restart picks the same), at
    most their first SAMPLE_CHARS characters, with the trainer's tokenizer: metadata sample_chars and sample_tokens,
    from which each Tally's token figure is estimated. every=1 counts every document (exact up to SAMPLE_CHARS)."""

    type = "🔢 - TOKENIZER"
    name = "token sample"

    def __init__(self, tokenizer_path, every):
        super().__init__(tokenizer_path)
        self.every = every

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for doc in data:
            if zlib.crc32(doc.id.encode("utf-8", "surrogatepass")) % self.every == 0:
                text = doc.text[:SAMPLE_CHARS]
                doc.metadata["sample_chars"] = len(text)
                doc.metadata["sample_tokens"] = len(self.tokenizer.encode(text, add_special_tokens=False).ids)
            yield doc


class Tally(PipelineStep):
    """Counts the documents and characters that reach it, and the token sample's documents, characters and tokens
    among them; passes them on."""

    type = "📊 - STATS"

    def __init__(self, label):
        self.name = f"tally {label}"  # before the parent's __init__, which names the stats after it
        super().__init__()

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        counts = dict.fromkeys(("documents", "characters", "sampled_documents", "sampled_characters",
                                "sampled_tokens"), 0)
        for doc in data:  # summed here, one stat_update each at the end: datatrove's costs ~20 us a call
            counts["documents"] += 1
            counts["characters"] += len(doc.text)
            if "sample_tokens" in doc.metadata:
                counts["sampled_documents"] += 1
                counts["sampled_characters"] += doc.metadata["sample_chars"]
                counts["sampled_tokens"] += doc.metadata["sample_tokens"]
            yield doc
        for key, value in counts.items():
            self.stat_update(key, value=value)


class RankFileReader(WithoutDocStats, JsonlReader):
    """datatrove's JsonlReader of a work folder, without its per-document statistic, where task r reads the file
    task r of the stage that wrote the folder wrote (none if it wrote none; datatrove's reader would give task r the
    r-th file there is): the documents a signature's index counts."""

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if data:
            yield from data
        name = f"{rank:05d}.jsonl"
        yield from self.read_files_shard([name] if self.data_folder.exists(name) else [])

    def read_file(self, filepath: str):
        """JsonlReader.read_file without its timer call a line (these files are the run's own: every line a row)."""
        with self.data_folder.open(filepath, "rb") as f:
            for index, line in enumerate(f):
                yield self.get_document_from_dict(orjson.loads(line), filepath, index)


class ExactSignatureOnTheWay(ExactDedupSignature):
    """datatrove's ExactDedupSignature that passes the documents on: put before the writer of the folder whose
    documents its indices count, it saves a stage that reads them again."""

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        hashes, content, hash_fc = array.array("Q"), self.config.content_getter, self.hash_fc
        for doc in data:
            hashes.append(hash_fc(content(doc)))
            yield doc
        signatures = np.zeros(len(hashes), dtype=get_sig_dtype(self.config.hash_config))
        signatures["hash"], signatures["priority"], signatures["doc"] = hashes, 1, np.arange(len(hashes))
        self.stat_update(StatHints.total, value=len(hashes))
        self.save_hashes(rank, signatures)


class WorkWriter(WithoutDocStats, JsonlWriter):
    """datatrove's JsonlWriter without its three statistics per document (doc_len, the file's count and the total:
    the report has Tally); one file per task, as JsonlWriter's default (no size limit)."""

    def write(self, document: Document, rank: int = 0, **kwargs):
        name = self._get_output_filename(document, rank, **kwargs)
        self._write(self.adapter(document), self._get_output_file_with_retry(name), name)


class ExactFilter(WithoutDocStats, ExactDedupFilter):
    """datatrove's ExactDedupFilter (the documents of this task whose index ExactFindDedups listed are dropped) with
    its statistics summed once (six stat and timer calls a document) and without its duplicate_count metadata (the
    output rows are the input rows). A listed index past the last document is an error, as in datatrove."""

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        folders = self.data_folder.list_files(include_directories=True, recursive=False)
        paths = [f"{folder}/{rank:05d}{ExtensionHelperSD.stage_2_duplicates}" for folder in folders]
        dtype = get_sig_dtype(self.config.hash_config)[2]
        listed = [self.read_duplicates(self.data_folder.open(path, "rb"), dtype) for path in paths
                  if self.data_folder.exists(path)]
        drop = set(np.concatenate(listed).tolist()) if listed else set()
        documents = 0
        with self.exclusion_writer if self.exclusion_writer else contextlib.nullcontext() as writer:
            for index, doc in enumerate(data):
                documents += 1
                if index not in drop:
                    yield doc
                elif writer:
                    writer.write(doc, rank=rank)
        if drop and max(drop) >= documents:
            raise ValueError(f"exact duplicates of task {rank} name document {max(drop)} of {documents}: the work "
                             "folder does not match its signatures; delete it to start over")
        self.stat_update(StatHints.total, value=documents)
        self.stat_update(StatHints.forwarded, value=documents - len(drop))
        self.stat_update(StatHints.dropped, value=len(drop))


class DecontFilter(WithoutDocStats, NGramsDecontFilter):
    """datatrove's NGramsDecontFilter without its per-document statistic."""


def document_row(self, document: Document) -> dict:
    """Writer adapter of the work folders: datatrove's row format (text, id, metadata) without its default adapter's
    dataclasses.asdict, which deep-copies every document's metadata (the input row) before writing it."""
    return {"text": document.text, "id": document.id, "metadata": document.metadata}


class EvalFilesIndexer(PipelineStep):
    """datatrove's decontamination index from local JSONL files: every string value of a row (question, choices,
    answer) adds its n-grams to the index of its file, named after the file. Hashes are datatrove's own
    (NGramsDecontIndexer.compute_hashes), so its NGramsDecontFilter matches them; that class itself asks for lighteval,
    which it needs only to load tasks from the Hub."""

    type = "🦠 - DECONT"
    name = "index of eval files"

    def __init__(self, output_folder, eval_paths, config, language):
        super().__init__()
        self.output_folder = get_datafolder(output_folder)
        self.eval_paths, self.config = list(eval_paths), config
        self.tokenizer = load_word_tokenizer(language)
        self.hash_func = create_hash_func(config.hash_config)

    compute_hashes = NGramsDecontIndexer.compute_hashes  # reads self.tokenizer, self.config, self.hash_func

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1):
        for path in self.eval_paths:
            hashes = set()
            with open(path, "rb") as f:
                for index, line in enumerate(f):
                    if line.strip():
                        for text in string_values(parsed_line(path, index, line)):
                            hashes.update(self.compute_hashes(text))
            name = os.path.splitext(os.path.basename(path))[0].replace(" ", "_")
            with self.output_folder.open(f"{name}.index.hashes", mode="wb") as f:
                f.write(np.array(sorted(hashes), dtype=self.config.hash_config.np_descr).tobytes())
            self.stat_update(f"hashes_{name}", value=len(hashes))


def string_values(value):
    """Every string inside a JSON value, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from string_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from string_values(item)
