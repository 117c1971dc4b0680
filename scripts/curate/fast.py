"""Exact, faster equivalents of the per-document functions that dominated scripts/curate_data.py's profile.

Each returns what its reference returns (tests/test_curate_data.py compares them on crafted texts):
- char_classes: counts through a code point -> class table instead of a unicodedata call per character;
- BatchNgrams(words of each document).duplicated_chars(ns): datatrove's find_all_duplicate (Gopher's duplicated
  n-gram characters) of every document for every n; a hash of every n-gram of a batch of documents (numpy, one sort)
  proves most n-grams unique, and the greedy scan visits only n-grams whose hash repeats, comparing the strings;
- top_repeated(words, n): Counter(ngrams(words, n)).most_common(1) through integer keys and numpy, after
  BatchNgrams.top_repeated_chars_at_most(n), a bound that clears most documents without it;
- simplify_text: datatrove's simplify_text, the combining marks (Mn) it drops deleted by str.translate.
"""
import sys
import unicodedata
from collections import Counter
from dataclasses import replace

import numpy as np
from datatrove.utils.text import DEF_TEXT_NORM_CONFIG, ngrams
from datatrove.utils.text import simplify_text as datatrove_simplify_text

SPACE, OTHER, ALNUM, SYMBOL = 0, 1, 2, 3
_tables = {}
_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_BASE_INVERSE = pow(_BASE, -1, 2**64)
_powers = {"up": np.ones(1, np.uint64), "down": np.ones(1, np.uint64)}
_SALT = 0xD6E8FEB86659FD93  # odd: documents and n apart, keys stay distinct


def class_table():
    """uint8 class (SPACE, OTHER, ALNUM, SYMBOL) of every Basic Multilingual Plane code point, built once."""
    if "classes" not in _tables:
        table = np.full(0x10000, OTHER, np.uint8)
        for code in range(0x10000):
            table[code] = char_class(chr(code))
        _tables["classes"] = table
    return _tables["classes"]


def char_class(ch):
    """SPACE, ALNUM (Unicode L*, N*), SYMBOL (Unicode S* outside ASCII) or OTHER. ASCII's symbols (| < > = + $ ^ ` ~)
    are markdown tables, HTML and code, not the emoji and box drawing the symbol rule is for: OTHER."""
    if ch.isspace():
        return SPACE
    category = unicodedata.category(ch)[0]
    return ALNUM if category in "LN" else SYMBOL if category == "S" and not ch.isascii() else OTHER


def code_points(text):
    """uint32 code points of `text` (lone surrogates included)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def char_classes(text):
    """(non-space characters, letters and digits (Unicode L*, N*), symbols (Unicode S* outside ASCII)) of `text`."""
    points = code_points(text)
    astral = points > 0xFFFF
    counts = np.bincount(class_table()[points[~astral]], minlength=4).tolist()
    for code in points[astral].tolist():  # emoji and rarer scripts: one lookup each
        counts[char_class(chr(code))] += 1
    return len(text) - counts[SPACE], counts[ALNUM], counts[SYMBOL]


def _power_table(name, base, length):
    """base**i mod 2**64 for i < length (uint64 products wrap modulo 2**64), grown as needed."""
    table = _powers[name]
    if len(table) < length:
        steps = np.full(max(length, 2 * len(table)), base, dtype=np.uint64)
        steps[0] = 1
        with np.errstate(over="ignore"):
            table = _powers[name] = np.cumprod(steps, dtype=np.uint64)
    return table[:length]


def repeated(values):
    """Boolean mask of the entries of `values` (uint64) that occur more than once."""
    ordered = np.sort(values)
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return np.zeros(len(values), dtype=bool)
    twice = np.unique(ordered[1:][same])
    seen = np.zeros(1 << 16, dtype=bool)  # by the top 16 bits: a cheap first look, exact below for its few hits
    seen[twice >> np.uint64(48)] = True
    mask = seen[values >> np.uint64(48)]
    maybe = np.flatnonzero(mask)
    mask[maybe] = twice[np.minimum(np.searchsorted(twice, values[maybe]), len(twice) - 1)] == values[maybe]
    return mask


class BatchNgrams:
    """The n-grams of a batch of documents' words, all documents at once: a polynomial hash modulo 2**64 of each
    n-gram's concatenated characters (equal strings, equal hashes), salted by document and n, so one sort over the
    batch finds what repeats inside each document."""

    def __init__(self, words_per_doc):
        self.words_per_doc = words_per_doc
        self.sizes = np.fromiter(map(len, words_per_doc), dtype=np.int64, count=len(words_per_doc))
        words = [word for doc in words_per_doc for word in doc]
        self.joined = "".join(words)
        self.offsets = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=len(words)), out=self.offsets[1:])
        points = code_points(self.joined).astype(np.uint64)
        self.prefix = np.zeros(len(points) + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(points * _power_table("up", _BASE, len(points)), out=self.prefix[1:])
        self.first = np.cumsum(self.sizes) - self.sizes  # each document's first word in the batch
        self.doc = np.repeat(np.arange(len(words_per_doc)), self.sizes)  # each word's document
        self.room = self.sizes[self.doc] - (np.arange(len(words)) - self.first[self.doc])  # words left in its doc
        self.pair_counts = None

    def keys(self, n):
        """(the batch index of each n-gram's first word, its hash salted by its document and n)."""
        starts = np.flatnonzero(self.room >= n)
        begin, end = self.offsets[starts], self.offsets[starts + n]
        salt = (self.doc[starts].astype(np.uint64) * np.uint64(64) + np.uint64(n)) * np.uint64(_SALT)
        with np.errstate(over="ignore"):
            hashes = (self.prefix[end] - self.prefix[begin]) * _power_table("down", _BASE_INVERSE,
                                                                             len(self.prefix))[begin]
            return starts, hashes + salt

    def duplicated_chars(self, ns):
        """{n: datatrove's find_all_duplicate(words, n) of each document}: characters in n-grams (words joined
        without spaces) seen before, scanning left to right and jumping past each repeat. Only n-grams whose hash
        repeats can repeat: the scan visits them alone (the rest never match and are never matched)."""
        keyed = [self.keys(n) for n in ns]
        repeats = repeated(np.concatenate([keys for _, keys in keyed]))
        out, at, offsets = {}, 0, None
        for n, (starts, _) in zip(ns, keyed):
            out[n] = np.zeros(len(self.sizes), dtype=np.int64)
            candidates = starts[repeats[at:at + len(starts)]]
            at += len(starts)
            if not len(candidates):
                continue
            offsets = self.offsets.tolist() if offsets is None else offsets
            docs, bounds = np.unique(self.doc[candidates], return_index=True)
            for d, group in zip(docs.tolist(), np.split(candidates, bounds[1:])):
                out[n][d] = _greedy_repeats(self.joined, offsets, group.tolist(), n)
        return out

    def top_repeated_chars_at_most(self, n):
        """An upper bound, per document, of count * characters of every n-gram (words as tuples), n >= 2, 0 without
        n-grams: an n-gram occurs at most as often as the 2-gram it starts with, so count * characters <= (count of
        the 2-gram at i) * (characters of the n-gram at i) at each of its positions i. 2-grams are grouped by a hash
        of their words' hashes (equal tuples, equal hash; a collision only merges groups)."""
        if self.pair_counts is None:
            self.pair_counts = np.zeros(len(self.doc), dtype=np.int64)
            _, words = self.keys(1)
            ends = np.flatnonzero(self.room >= 2)
            with np.errstate(over="ignore"):
                pairs = words[ends] * np.uint64(_BASE) + words[ends + 1]
            _, inverse, counts = np.unique(pairs, return_inverse=True, return_counts=True)
            self.pair_counts[ends] = counts[inverse]
        products = np.zeros(len(self.doc), dtype=np.int64)
        starts = np.flatnonzero(self.room >= n)
        products[starts] = self.pair_counts[starts] * (self.offsets[starts + n] - self.offsets[starts])
        out = np.zeros(len(self.sizes), dtype=np.int64)
        some = self.sizes > 0
        if some.any():
            out[some] = np.maximum.reduceat(products, self.first[some])
        return out


def _greedy_repeats(joined, offsets, starts, n):
    """find_all_duplicate's scan over the n-grams starting at `starts` (ascending batch word indices of one
    document, every n-gram that can repeat among them)."""
    seen, total, position = set(), 0, 0
    for start in starts:
        if start < position:
            continue  # inside a repeat the scan jumped over
        gram = joined[offsets[start]:offsets[start + n]]
        if gram in seen:
            total += len(gram)
            position = start + n
        else:
            seen.add(gram)
            position = start + 1
    return total


def word_ids(words):
    """An integer per distinct word of `words`, in order of first occurrence: int64 array."""
    vocabulary = {}
    return np.array([vocabulary.setdefault(w, len(vocabulary)) for w in words], np.int64)


def top_repeated(words, n, ids=None):
    """Counter(ngrams(words, n)).most_common(1)[0] as (gram, count), or None without n-grams: the most frequent
    n-gram, the first to occur among equals. ids: word_ids(words), when the caller has them."""
    if len(words) < n:
        return None
    ids = word_ids(words) if ids is None else ids
    size = max(int(ids.max()) + 1, 2)
    if size ** n >= 2**62:  # keys would overflow int64: the plain count
        return Counter(ngrams(words, n)).most_common(1)[0]
    keys = np.zeros(len(words) - n + 1, dtype=np.int64)
    for k in range(n):
        keys = keys * size + ids[k:len(words) - n + 1 + k]
    _, first, counts = np.unique(keys, return_index=True, return_counts=True)
    top = counts.max()
    start = int(first[counts == top].min())
    return tuple(words[start:start + n]), int(top)


def mark_table():
    """str.translate table deleting every combining mark (Unicode Mn) of this Python's unicodedata."""
    if "marks" not in _tables:
        _tables["marks"] = dict.fromkeys(c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Mn")
    return _tables["marks"]


_NO_DIACRITICS = {}


def simplify_text(text, config=DEF_TEXT_NORM_CONFIG):
    """datatrove's simplify_text(text, config); its last step (NFD, drop Mn characters, strip) by str.translate."""
    if not config.norm_unicode_diacritics:
        return datatrove_simplify_text(text, config)
    if id(config) not in _NO_DIACRITICS:
        _NO_DIACRITICS[id(config)] = (config, replace(config, norm_unicode_diacritics=False))
    text = datatrove_simplify_text(text, _NO_DIACRITICS[id(config)][1])
    if text.isascii():  # NFD leaves ASCII as it is and ASCII has no combining marks
        return text
    return unicodedata.normalize("NFD", text).translate(mark_table()).strip()
