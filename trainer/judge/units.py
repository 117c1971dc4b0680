"""Units that compare across tokenizers and runs: bits per byte of the eval text (the summed CE in nats over the UTF-8
bytes of the target tokens), and the repetition of generated text (the share of repeated 4-grams, distinct-2)."""
import math

import torch

_BYTE_TABLES = {}  # id(tokenizer) -> the table, built once per run


def byte_level_decoder():
    """GPT-2's byte-level BPE alphabet (what `tokenizers` ByteLevel uses), reversed: {printable char: byte}."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_byte_lengths(tokenizer):
    """A LongTensor (len(tokenizer),): the UTF-8 bytes each token id stands for in the decoded text (a byte-level
    piece: its bytes; a special or added token: its text's UTF-8 length, as it appears in a rendered chat)."""
    key = id(tokenizer)
    if key not in _BYTE_TABLES:
        decoder, added = byte_level_decoder(), set(tokenizer.get_added_vocab())
        lengths = []
        for piece in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
            piece = piece or ""
            if piece not in added and all(c in decoder for c in piece):
                lengths.append(len(piece))  # one byte per byte-level character
            else:
                lengths.append(len(piece.encode("utf-8")))
        _BYTE_TABLES[key] = torch.tensor(lengths, dtype=torch.long)
    return _BYTE_TABLES[key]


def target_bytes(byte_lengths, targets):
    """The UTF-8 bytes of the target tokens (targets != -100) of a CPU tensor of token ids."""
    kept = targets[targets != -100]
    return int(byte_lengths[kept].sum()) if kept.numel() else 0


def bits_per_byte(nats, num_bytes):
    """Summed cross-entropy in nats over the bytes it was measured on -> bits per byte (None without bytes)."""
    return nats / (math.log(2) * num_bytes) if num_bytes > 0 else None


def repetition(ids, n=4):
    """(share of repeated n-grams, distinct-2) of a token id list: the n-grams that are a repeat of an earlier one
    over all n-grams (0: none repeated), and the distinct bigrams over all bigrams (1: none repeated)."""
    ids = list(ids)
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    bigrams = [tuple(ids[i:i + 2]) for i in range(len(ids) - 1)]
    repeated = (len(grams) - len(set(grams))) / len(grams) if grams else 0.0
    distinct2 = len(set(bigrams)) / len(bigrams) if bigrams else 1.0
    return repeated, distinct2
