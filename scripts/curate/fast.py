"""Exact, faster equivalents of the per-document functions that dominated scripts/curate_data.py's profile.

Each returns what its reference returns (tests/test_curate_data.py compares them on crafted texts):
- char_classes: counts through a code point -> class table instead of a unicodedata call per character;
- WordNgrams(words).duplicated_chars(n): datatrove's find_all_duplicate (Gopher's duplicated n-gram characters); a
  hash of every n-gram (numpy) proves most n-grams unique, and the greedy scan visits only n-grams whose hash
  repeats, comparing the strings themselves;
- WordNgrams(words).top_repeated(n): Counter(ngrams(words, n)).most_common(1) through integer keys and numpy, after
  top_repeated_chars_at_most(n), a bound that clears most documents without it;
- simplify_text: datatrove's simplify_text, the combining marks (Mn) it drops deleted by str.translate;
- sha1_shingles: datatrove's sha1_hash64 of each " "-joined n-gram, as one uint64 array.
"""
import hashlib
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
    """Boolean mask of the entries of `values` that occur more than once."""
    ordered = np.sort(values)
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return np.zeros(len(values), dtype=bool)
    return np.isin(values, ordered[1:][same])


class WordNgrams:
    """The n-grams of one document's words, for every n from one pass over the words: a polynomial hash modulo 2**64
    of each n-gram's concatenated characters (equal strings, equal hashes) and integer ids of the words."""

    def __init__(self, words):
        self.words, self.joined = words, "".join(words)
        self.offsets = np.zeros(len(words) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=len(words)), out=self.offsets[1:])
        points = code_points(self.joined).astype(np.uint64)
        self.prefix = np.zeros(len(points) + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(points * _power_table("up", _BASE, len(points)), out=self.prefix[1:])
        self.vocabulary, self.ids, self.pair_counts = None, None, None

    def hashes(self, n):
        """uint64 hash of the concatenated characters of each n-gram."""
        starts, ends = self.offsets[:len(self.words) - n + 1], self.offsets[n:]
        with np.errstate(over="ignore"):
            return (self.prefix[ends] - self.prefix[starts]) * _power_table("down", _BASE_INVERSE,
                                                                             len(self.prefix))[starts]

    def duplicated_chars(self, n):
        """datatrove's find_all_duplicate(words, n): characters in n-grams (words joined without spaces) seen
        before, scanning left to right and jumping past each repeat. Only n-grams whose hash occurs twice can
        repeat: the scan steps over the rest, which never match and are never matched."""
        if len(self.words) < n:
            return 0
        candidates = np.flatnonzero(repeated(self.hashes(n))).tolist()
        if not candidates:
            return 0
        seen, total, position, offsets = set(), 0, 0, self.offsets.tolist()
        for start in candidates:
            if start < position:
                continue  # inside a repeat the scan jumped over
            gram = self.joined[offsets[start]:offsets[start + n]]
            if gram in seen:
                total += len(gram)
                position = start + n
            else:
                seen.add(gram)
                position = start + 1
        return total

    def top_repeated(self, n):
        """Counter(ngrams(words, n)).most_common(1)[0] as (gram, count), or None without n-grams: the most
        frequent n-gram, the first to occur among equals."""
        words = self.words
        if len(words) < n:
            return None
        if self.ids is None:
            self.vocabulary = {}
            self.ids = np.array([self.vocabulary.setdefault(w, len(self.vocabulary)) for w in words], np.int64)
        size = max(len(self.vocabulary), 2)
        if size ** n >= 2**62:  # keys would overflow int64: the plain count
            return Counter(ngrams(words, n)).most_common(1)[0]
        keys = np.zeros(len(words) - n + 1, dtype=np.int64)
        for k in range(n):
            keys = keys * size + self.ids[k:len(words) - n + 1 + k]
        _, first, counts = np.unique(keys, return_index=True, return_counts=True)
        top = counts.max()
        start = int(first[counts == top].min())
        return tuple(words[start:start + n]), int(top)

    def top_repeated_chars_at_most(self, n):
        """An upper bound of count * characters of every n-gram (words as tuples), n >= 2, 0 without n-grams: an
        n-gram occurs at most as often as the 2-gram it starts with, so count * characters <= (count of the 2-gram at
        i) * (characters of the n-gram at i) at each of its positions i. 2-grams are counted once per document,
        grouped by a hash of their words' hashes (equal tuples, equal hash; a collision only merges groups)."""
        if len(self.words) < n:
            return 0
        if self.pair_counts is None:
            words = self.hashes(1)
            with np.errstate(over="ignore"):
                keys = words[:-1] * np.uint64(_BASE) + words[1:]
            _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
            self.pair_counts = counts[inverse]
        chars = self.offsets[n:] - self.offsets[:len(self.words) - n + 1]
        return int((self.pair_counts[:len(chars)] * chars).max())


def _mark_table():
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
    return unicodedata.normalize("NFD", text).translate(_mark_table()).strip()


def sha1_shingles(words, n):
    """datatrove's sha1_hash64 of each " "-joined n-gram of `words`, as slices of the words joined once: uint64 array
    of shape (n-grams, 1)."""
    spaced = " ".join(words)
    starts = np.zeros(len(words) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=len(words)) + 1, out=starts[1:])
    bounds = zip(starts[:len(words) - n + 1].tolist(), (starts[n:] - 1).tolist())
    sha1 = hashlib.sha1
    if spaced.isascii():  # character offsets are byte offsets
        data = spaced.encode("ascii")
        digests = b"".join([sha1(data[a:b]).digest()[:8] for a, b in bounds])
    else:
        digests = b"".join([sha1(spaced[a:b].encode("utf-8")).digest()[:8] for a, b in bounds])
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64).reshape((-1, 1))
