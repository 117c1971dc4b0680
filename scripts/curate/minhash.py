"""datatrove's MinHash signatures of a batch of documents at once, in numpy, bit for bit (tests/test_curate_data.py
compares them with datatrove's MinhashDedupSignature):
- sha1_hash64_many: SHA-1 (FIPS 180-4) of every shingle, each of its 80 rounds a few array operations over all the
  shingles, where hashlib costs a call, an object and a digest per 5-gram (a third of the curation's time);
- shingle_hashes: the " "-joined n-grams of each document's words as byte ranges of one buffer, hashed so;
- signatures: datatrove's permutations (a * x + b modulo 2**64, then modulo the Mersenne prime 2**61 - 1, taken by
  a shift and a mask instead of a division) and each document's minimum, a block of shingles at a time.
"""
import hashlib

import numpy as np

_H0 = (0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0)
_K = (0x5A827999, 0x6ED9EBA1, 0x8F1BBCDC, 0xCA62C1D6)
MERSENNE = np.uint64((1 << 61) - 1)  # datatrove's _mersenne_prime
SHA1_BATCH = 32_768  # messages hashed together: their working arrays (128 KB each) stay in the core's cache
NUMPY_MIN = 2_048  # fewer messages than this per block: hashlib, one call each, is faster than 1,400 array calls
PERMUTE_ROWS = 1_024  # shingles permuted together: 1,024 x 84 hashes, 0.7 MB a temporary


def shingle_hashes(spaced, sizes, n):
    """(sha1_hash64 of each n-gram of each document, uint64; n-grams per document, int64). spaced: each document's
    words joined by single spaces, the words free of whitespace (MixedScriptTokenizer's); sizes: their word counts.
    An n-gram's bytes are a slice of one UTF-8 buffer of them all: datatrove hashes " ".join(n-gram)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    data = "\n".join([text for text, size in zip(spaced, sizes.tolist()) if size]).encode("utf-8")
    buffer = np.frombuffer(data, dtype=np.uint8)
    separators = np.flatnonzero((buffer == 0x20) | (buffer == 0x0A))
    word_starts, word_ends = np.r_[0, separators + 1], np.r_[separators, len(buffer)]
    sizes_in = sizes[sizes > 0]
    position = np.arange(sizes_in.sum()) - np.repeat(np.cumsum(sizes_in) - sizes_in, sizes_in)  # word i of its doc
    first = np.flatnonzero(position <= np.repeat(sizes_in - n, sizes_in))  # each n-gram's first word
    starts, ends = word_starts[first], word_ends[first + n - 1]
    hashes = np.empty(len(first), dtype=np.uint64)
    for lo in range(0, len(first), SHA1_BATCH):
        hashes[lo:lo + SHA1_BATCH] = sha1_hash64_many(data, starts[lo:lo + SHA1_BATCH], ends[lo:lo + SHA1_BATCH])
    return hashes, np.maximum(sizes - n + 1, 0)


def signatures(hashes, counts, a, b):
    """datatrove's MinhashDedupSignature.get_signature before its split into buckets, for every document: the
    minimum over its shingles of (a * shingle + b) % (2**61 - 1) (uint64 arithmetic, wrapping as datatrove's numpy
    does), uint64 array (documents, len(a)). A document without shingles keeps 2**64 - 1 in every column."""
    a, b = a.reshape(1, -1), b.reshape(1, -1)
    out = np.full((len(counts), a.shape[1]), np.iinfo(np.uint64).max, dtype=np.uint64)
    owner = np.repeat(np.arange(len(counts)), counts)  # the document of each shingle
    for lo in range(0, len(hashes), PERMUTE_ROWS):
        block = hashes[lo:lo + PERMUTE_ROWS, None] * a
        block += b
        high = block >> np.uint64(61)
        block &= MERSENNE
        block += high  # < 2**61 + 7: at most one more subtraction
        np.minimum(block, block - MERSENNE, out=block)  # block - p wraps above block when block < p
        docs = owner[lo:lo + PERMUTE_ROWS]
        first = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        ids = docs[first]
        out[ids] = np.minimum(out[ids], np.minimum.reduceat(block, first, axis=0))
    return out


def sha1_hash64_many(data, starts, ends):
    """datatrove's sha1_hash64_bytes (the digest's first 8 bytes, little-endian) of data[starts[i]:ends[i]] for
    every i: uint64 array. `data` is bytes, `starts` and `ends` int64 arrays of byte offsets. Messages of a length
    too rare to fill the arrays (fewer than NUMPY_MIN per 64-byte block) go through hashlib."""
    lengths = ends - starts
    blocks = (lengths + 8) // 64 + 1  # the message, one 0x80 byte and the 8-byte bit length, in 64-byte blocks
    out = np.empty(len(starts), dtype=np.uint64)
    buffer = np.frombuffer(data, dtype=np.uint8)
    for count in np.unique(blocks).tolist():
        chosen = np.flatnonzero(blocks == count)
        if len(chosen) >= NUMPY_MIN * count:
            out[chosen] = _digest64(_padded_words(buffer, starts[chosen], lengths[chosen], count))
        else:
            view, sha1 = memoryview(data), hashlib.sha1
            digests = b"".join([sha1(view[a:b]).digest()[:8] for a, b in zip(starts[chosen].tolist(),
                                                                               ends[chosen].tolist())])
            out[chosen] = np.frombuffer(digests, dtype="<u8")
    return out


def _padded_words(data, starts, lengths, count):
    """The padded messages of `count` blocks each as big-endian 32-bit words: uint32 array (count * 16, messages)."""
    width = 64 * count
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([data, np.zeros(width, np.uint8)]), width)
    padded = windows[starts]  # a copy: row i holds data[starts[i]:starts[i] + width]
    np.multiply(padded, np.arange(width, dtype=np.int32) < lengths.astype(np.int32)[:, None], out=padded)
    padded[np.arange(len(starts)), lengths] = 0x80
    padded[:, width - 8:] = (lengths * 8).astype(">u8")[:, None].view(np.uint8)
    return padded.view(">u4").T.astype(np.uint32, order="C")


def _rotl(x, n, out, spare):
    """out = x rotated left by n bits (out is not x; spare is scratch)."""
    np.left_shift(x, n, out=out)
    np.right_shift(x, 32 - n, out=spare)
    out |= spare


def _digest64(words):
    """The first 8 bytes of each message's SHA-1 digest as a little-endian uint64; words: _padded_words's array."""
    size = words.shape[1]
    state = [np.full(size, h, dtype=np.uint32) for h in _H0]
    temp, f, spare, mixed = (np.empty(size, dtype=np.uint32) for _ in range(4))
    for block in range(words.shape[0] // 16):
        a, b, c, d, e = (h.copy() for h in state)
        w = words[16 * block:16 * block + 16]
        for t in range(80):
            if t >= 16:  # the message schedule, 16 words kept: w[t] = rotl(w[t-3] ^ w[t-8] ^ w[t-14] ^ w[t-16], 1)
                np.bitwise_xor(w[(t - 3) % 16], w[(t - 8) % 16], out=mixed)
                mixed ^= w[(t - 14) % 16]
                mixed ^= w[t % 16]
                _rotl(mixed, 1, w[t % 16], spare)
            _round_function(t, b, c, d, f, spare)
            _rotl(a, 5, temp, spare)
            temp += f
            temp += e
            temp += np.uint32(_K[t // 20])
            temp += w[t % 16]
            _rotl(b, 30, e, spare)  # e is dead: it holds the next c
            a, b, c, d, e, temp = temp, a, e, c, d, b  # b's buffer is free for the next round's temp
        for h, value in zip(state, (a, b, c, d, e)):
            h += value
    return np.stack(state[:2], axis=1).astype(">u4").view("<u8").ravel()


def _round_function(t, b, c, d, f, spare):
    """f = SHA-1's round function of (b, c, d) for round t: choose, parity or majority."""
    if t < 20:
        np.bitwise_xor(c, d, out=f)
        f &= b
        f ^= d
    elif 40 <= t < 60:
        np.bitwise_or(b, c, out=f)
        f &= d
        np.bitwise_and(b, c, out=spare)
        f |= spare
    else:
        np.bitwise_xor(b, c, out=f)
        f ^= d
