"""
PretrainDataset and SFTDataset (MiniMind's), backed by an on-disk token cache.

Each file is tokenized once per node (dataset/token_cache.py: the local ranks split it, each with
`num_proc` worker processes), in chunks through the fast tokenizer's batch API, into flat numpy arrays
under dataset/.cache/ (tokens uint16/uint32, int64 document offsets, uint8 loss mask for SFT) that are
read back with numpy.memmap: the corpus never lives in memory as Python strings.
The cache key covers the file (path, size, mtime), the tokenizer and the format version.

Both datasets return `(input_ids, labels)` LongTensors of length max_length, labels aligned with
input_ids (the trainer shifts them) and -100 where there is no loss; packed rows with doc_mask add
per-document position ids as a third tensor.

What SFT labels: exactly what the assistant generates after its role header, in every assistant turn:
    <think>\n{reasoning_content}\n</think>\n\n{content}<tool_call>...</tool_call><|im_end|>
that is the reasoning with its think tags (an empty think block where there is no reasoning, as
MiniMind-3's template renders it), the content, the tool calls, and the eos closing the turn.
Not labelled: the system prompt and tools schema, user turns, tool responses (rendered as user turns:
they come from the environment, not the model), the role header "<|im_start|>assistant\n" (the prompt
supplies it), the "\n" after <|im_end|> (generation stops at eos) and padding. Why: the loss is the
model's own output given everything it is shown, so it learns to reason, answer, call tools and stop.
Unlike MiniMind, empty think blocks are never dropped at random: the cache is a pure function of the file.
"""
import bisect
import hashlib
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.token_cache import CACHE_FORMAT_VERSION, build_token_cache, discard_if_damaged

DATASET_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CACHE_DIR = os.path.join(DATASET_DIR, ".cache")
CHUNK_DOCS = 1024  # documents per tokenizer batch call: big enough for speed, small enough for memory
SCAN_TOKENS = 1 << 26  # mask bytes read per block when counting rows without targets: bounded memory


def _check_text(value):
    return None if isinstance(value, str) else f"'text' must be a string, got {type(value).__name__}"


def _json_list(value, name):
    """A list given as such or as its JSON text (MiniMind-3's sft_t2t stores tools and tool_calls as strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"'{name}' is not valid JSON ({e})") from None
    if not isinstance(value, list):
        raise ValueError(f"'{name}' must be a list (or its JSON string), got {type(value).__name__}")
    return value


def _chat_messages(value):
    """(messages, tools) for apply_chat_template from one 'conversations' value; ValueError says what is wrong.

    Null fields are dropped (parquet and `datasets` fill absent ones with null); a missing content is "";
    'tools' (on any message, MiniMind-3 puts it on the system one) and 'tool_calls' are decoded from JSON.
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("'conversations' must be a non-empty list of messages")
    messages, tools = [], None
    for i, raw in enumerate(value):
        if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
            raise ValueError(f"message {i} of 'conversations' needs a string 'role'")
        message = {key: v for key, v in raw.items() if v is not None}
        try:
            if message.pop("tools", ""):
                tools = _json_list(raw["tools"], "tools")
            if message.get("tool_calls", "") != "":
                message["tool_calls"] = _json_list(message["tool_calls"], "tool_calls")
            else:
                message.pop("tool_calls", None)
        except ValueError as e:
            raise ValueError(f"message {i}: {e}") from None
        message.setdefault("content", "")
        for field in ("content", "reasoning_content"):
            if not isinstance(message.get(field, ""), str):
                raise ValueError(f"message {i}: '{field}' must be a string, got {type(message[field]).__name__}")
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing to learn from")
    return messages, tools


# ----------------------------------------------------------------------------- the token cache

def _tokenizer_fingerprint(tokenizer):
    """Hash of everything about the tokenizer that changes the cached ids and masks."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [type(tokenizer).__name__, len(tokenizer), vocab, tokenizer.bos_token_id,
             tokenizer.eos_token_id, tokenizer.eos_token, getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _cache_dir_for(kind, data_path, tokenizer, skip_bad_lines, cache_dir):
    stat = os.stat(data_path)
    key = [CACHE_FORMAT_VERSION, kind, os.path.abspath(data_path), stat.st_size, stat.st_mtime_ns,
           _tokenizer_fingerprint(tokenizer), bool(skip_bad_lines)]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"{os.path.basename(data_path)}.{kind}.{digest}")


def _build_cache(dataset, skip_bad_lines, num_proc, part):
    """Tokenize dataset.data_path into dataset.cache_path, once per node (see dataset/token_cache.py)."""
    build_token_cache(dataset.cache_path, dataset.data_path, dataset.field, dataset._tokenized_chunks,
                      dataset.token_dtype, skip_bad_lines, num_proc=num_proc, part=part)


# ----------------------------------------------------------------------------- pretokenized shards
# scripts/pretokenize.py writes <prefix>.bin (tokens), <prefix>.idx (int64 document offsets),
# <prefix>.mask (uint8 loss mask, SFT only) and <prefix>.json (meta): the token cache's arrays, renamed.
SHARD_SUFFIX = ".bin"


def shard_files(prefix):
    """Paths of a pretokenized shard's files, keyed as in the token cache."""
    return {"tokens": prefix + ".bin", "offsets": prefix + ".idx", "mask": prefix + ".mask", "meta": prefix + ".json"}


def _open_shard(token_path, kind, tokenizer):
    """(meta, files) of a pretokenized shard; refuses a shard of another kind or tokenizer."""
    files = shard_files(token_path[:-len(SHARD_SUFFIX)])
    for name in ("offsets", "meta"):
        if not os.path.isfile(files[name]):
            raise FileNotFoundError(f"{token_path}: pretokenized shard without {files[name]}; "
                                    "rebuild it with scripts/pretokenize.py")
    with open(files["meta"]) as f:
        meta = json.load(f)
    if meta.get("kind") != kind:
        raise ValueError(f"{token_path} holds {meta.get('kind')} data, not {kind}")
    if meta.get("tokenizer") != _tokenizer_fingerprint(tokenizer):
        raise ValueError(f"{token_path} was tokenized with another tokenizer; rebuild it with scripts/pretokenize.py")
    return meta, files


class _TokenCacheDataset(Dataset):
    """Common part: validate arguments, build or reuse the cache, memmap it lazily."""

    kind = field = None

    def __init__(self, data_path, tokenizer, max_length, skip_bad_lines, cache_dir, num_proc, part):
        data_path = os.fspath(data_path)
        if not os.path.isfile(data_path):
            raise FileNotFoundError(f"data file not found: {data_path}")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name) is None:
                raise ValueError(f"tokenizer has no {name}; set it in tokenizer_config.json")
        self.data_path, self.tokenizer, self.max_length = data_path, tokenizer, max_length
        self.pad_token_id = tokenizer.pad_token_id
        self.token_dtype = np.uint16 if len(tokenizer) <= 65536 else np.uint32
        if data_path.endswith(SHARD_SUFFIX):  # pretokenized by scripts/pretokenize.py: no cache to build
            self.cache_path = None
            self.meta, files = _open_shard(data_path, self.kind, tokenizer)
        else:
            self.cache_path = _cache_dir_for(self.kind, data_path, tokenizer, skip_bad_lines,
                                             cache_dir or DEFAULT_CACHE_DIR)
            if not discard_if_damaged(self.cache_path, quiet=part[0] != 0):  # absent, or damaged: built (again)
                _build_cache(self, skip_bad_lines, num_proc, part)
            with open(os.path.join(self.cache_path, "meta.json")) as f:
                self.meta = json.load(f)
            files = {name: os.path.join(self.cache_path, f"{name}.bin") for name in ("tokens", "offsets", "mask")}
        self._token_file, self._mask_file = files["tokens"], files["mask"]
        self.num_bad_lines = self.meta["num_bad_lines"]
        self.offsets = np.fromfile(files["offsets"], dtype=np.int64)
        self._tokens = self._mask = None

    def _tokenized_chunks(self, records, bad_lines):
        """Chunks (lists) of (ids, mask or None) from (lineno, value, error) records; runs in worker processes."""
        raise NotImplementedError

    def _arrays(self):
        """Open the memmaps on first use in each process (DataLoader workers included)."""
        if self._tokens is None:
            self._tokens = np.memmap(self._token_file, dtype=self.meta["token_dtype"], mode="r")
            if os.path.exists(self._mask_file):
                self._mask = np.memmap(self._mask_file, dtype=np.uint8, mode="r")
        return self._tokens, self._mask

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tokens"] = state["_mask"] = None  # pickling a memmap would copy the whole corpus
        return state

    def _padded(self, ids, labels):
        """Pad to max_length: pad_token_id in input_ids, -100 in labels."""
        input_ids = torch.full((self.max_length,), self.pad_token_id, dtype=torch.long)
        target = torch.full((self.max_length,), -100, dtype=torch.long)
        input_ids[:len(ids)] = torch.from_numpy(ids.astype(np.int64))
        target[:len(labels)] = torch.from_numpy(labels.astype(np.int64))
        return input_ids, target


# ----------------------------------------------------------------------------- packing SFT rows
def pack_conversations(lengths, max_length):
    """Best-fit decreasing: place conversations of `lengths` (each <= max_length) into rows of max_length tokens.

    Returns (row_offsets, slots): row r holds conversations slots[row_offsets[r]:row_offsets[r + 1]] (indices
    into `lengths`), in ascending order; rows are ordered by their first conversation. A pure function of the
    lengths, so every rank and every layout packs alike. O(n log max_length).
    """
    free, rows_with, rows = [], {}, []  # sorted distinct free spaces of open rows, space -> rows, row -> slots
    for slot in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        need = int(lengths[slot])
        k = bisect.bisect_left(free, need)
        if k == len(free):  # no open row has room: open one
            row, space = len(rows), max_length
            rows.append([])
        else:
            space = free[k]
            row = rows_with[space].pop()
            if not rows_with[space]:
                del rows_with[space], free[k]
        rows[row].append(slot)
        space -= need
        if space > 0:
            if space not in rows_with:
                bisect.insort(free, space)
                rows_with[space] = []
            rows_with[space].append(row)
    rows = sorted(sorted(row) for row in rows)
    row_offsets = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)
    return row_offsets, np.array([slot for row in rows for slot in row], dtype=np.int64)


# ----------------------------------------------------------------------------- the datasets

class PretrainDataset(_TokenCacheDataset):
    """Plain text ({"text": ...} JSONL or parquet): each sample is bos + text + eos.

    packing=False: one document per sample, truncated (eos kept) and padded to max_length.
    packing=True: all documents concatenated and cut into full rows of max_length (remainder dropped).
    doc_mask=True (with packing): samples are (input_ids, labels, position_ids), the position ids restarting
    at 0 where a document starts (and at the row's start), so the model attends within documents only.
    data_path may also be a pretokenized `<prefix>.bin` shard from scripts/pretokenize.py.
    num_proc, part=(local_rank, local_world_size): how the cache is built (dataset/token_cache.py).
    """

    kind, field = "pretrain", "text"

    def __init__(self, data_path, tokenizer, max_length=512, packing=False, skip_bad_lines=False, cache_dir=None,
                 num_proc=None, part=(0, 1), doc_mask=False):
        super().__init__(data_path, tokenizer, max_length, skip_bad_lines, cache_dir, num_proc, part)
        self.packing, self.doc_mask = packing, bool(doc_mask and packing)
        self.num_rows = int(self.offsets[-1]) // max_length if packing else len(self.offsets) - 1
        if self.num_rows == 0:
            raise ValueError(f"{data_path}: {int(self.offsets[-1])} tokens, fewer than max_length={max_length}: "
                             "nothing to pack")

    def _tokenized_chunks(self, records, bad_lines):
        bos, eos = [self.tokenizer.bos_token_id], [self.tokenizer.eos_token_id]
        texts = []
        for lineno, value, error in records:
            error = error or _check_text(value)
            if error:
                bad_lines(lineno, error)
                continue
            texts.append(value)
            if len(texts) == CHUNK_DOCS:
                yield [(bos + ids + eos, None) for ids in self._encode(texts)]
                texts = []
        if texts:
            yield [(bos + ids + eos, None) for ids in self._encode(texts)]

    def _encode(self, texts):
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast") and backend.truncation is None \
                and backend.padding is None:  # the same ids without offsets: ~20% less work than __call__
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def __len__(self):
        return self.num_rows

    def __getitem__(self, index):
        tokens, _ = self._arrays()
        if self.packing:
            start = index * self.max_length
            row = tokens[start:start + self.max_length]
            if self.doc_mask:
                return (*self._padded(row, row), self._row_positions(start))
            return self._padded(row, row)
        doc = tokens[self.offsets[index]:self.offsets[index + 1]]  # bos + text + eos
        if len(doc) > self.max_length:
            doc = np.concatenate([doc[:self.max_length - 1], doc[-1:]])  # = bos + text[:L-2] + eos
        return self._padded(doc, doc)


    def _row_positions(self, start):
        """Position ids of the packed row starting at token `start`: 0 at the row start and at each document start."""
        inside = self.offsets[np.searchsorted(self.offsets, start, side="right"):
                              np.searchsorted(self.offsets, start + self.max_length, side="left")]
        starts = np.concatenate([[0], inside - start])  # the documents' first tokens, within the row
        index = np.arange(self.max_length)
        return torch.from_numpy(index - starts[np.searchsorted(starts, index, side="right") - 1])


class SFTDataset(_TokenCacheDataset):
    """Chat data ({"conversations": [message, ...]} JSONL or parquet) rendered with the chat template.

    Messages are MiniMind-3's: role, content, and optionally reasoning_content, tools (the function
    schemas, on the system message) and tool_calls (on assistant messages), the last two as lists or
    as JSON strings. The schemas go to apply_chat_template(tools=...), so the template renders them.
    Labelling is described in the module docstring.

    packing=False: one conversation per sample, truncated and padded to max_length.
    packing=True: whole conversations (each truncated to max_length, never split across rows) packed into rows
    of max_length by pack_conversations, once, when the dataset is opened; conversations without a target are
    left out. Labels are the same tokens' labels. doc_mask=True (with packing): samples are (input_ids, labels,
    position_ids), positions restarting at 0 at each conversation, so the model attends within conversations.
    """

    kind, field = "sft", "conversations"

    def __init__(self, data_path, tokenizer, max_length=1024, skip_bad_lines=False, cache_dir=None, num_proc=None,
                 part=(0, 1), packing=False, doc_mask=False):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("SFTDataset needs a fast tokenizer (it maps assistant text to tokens by offsets)")
        super().__init__(data_path, tokenizer, max_length, skip_bad_lines, cache_dir, num_proc, part)
        self.packing, self.doc_mask = bool(packing), bool(doc_mask and packing)
        self.num_conversations = len(self.offsets) - 1
        has_target = self._has_targets()
        self.num_rows_without_targets = int((~has_target).sum())
        if self.num_conversations and self.num_rows_without_targets == self.num_conversations:
            raise ValueError(f"no row of {data_path} has an assistant token within --max_seq_len {max_length}; "
                             "raise --max_seq_len")
        if self.packing:  # conversations without a target add no loss and no gradient: they take no room
            kept = np.flatnonzero(has_target)
            lengths = np.minimum(self.offsets[kept + 1] - self.offsets[kept], max_length)
            self.row_offsets, row_slots = pack_conversations(lengths, max_length)
            self.row_docs = kept[row_slots]

    def no_target_line(self):
        """The one info line about rows that teach nothing at this max_length; None when every row has a target."""
        if not self.num_rows_without_targets:
            return None
        if self.packing:
            return (f"{self.num_rows_without_targets} of {self.num_conversations} conversations of {self.data_path} "
                    f"have no assistant token within --max_seq_len {self.max_length}; they teach nothing and are "
                    "left out of the packed rows")
        return (f"{self.num_rows_without_targets} of {len(self)} rows of {self.data_path} have no assistant token "
                f"within --max_seq_len {self.max_length}; they teach nothing")

    def _has_targets(self):
        """Per conversation: a labelled token at positions 1..max_length-1 (position 0 is never a target)."""
        _, mask = self._arrays()
        starts = self.offsets[:-1] + 1
        ends = np.minimum(self.offsets[1:], self.offsets[:-1] + self.max_length)
        if mask is None:
            return np.zeros(len(starts), dtype=bool)
        has_target, lo = [], 0
        while lo < len(starts):  # blocks of rows spanning at most SCAN_TOKENS tokens (one row at least)
            hi = max(lo + 1, int(np.searchsorted(self.offsets, self.offsets[lo] + SCAN_TOKENS, side="right")) - 1)
            s, e = starts[lo:hi], np.maximum(ends[lo:hi], starts[lo:hi])
            base = int(s[0])
            block = np.append(np.asarray(mask[base:int(e.max())]), np.uint8(0))  # reduceat needs every index < len
            windows = np.stack([s - base, e - base], axis=1).ravel()
            has_target.append((np.maximum.reduceat(block, windows)[0::2] > 0) & (e > s))  # an empty window has none
            lo = hi
        return np.concatenate(has_target) if has_target else np.zeros(0, dtype=bool)

    def _render(self, messages, tools, add_generation_prompt=False):
        """Chat template text of `messages`, or None where the template rejects the partial list."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception:
            return None

    def _assistant_spans(self, messages, tools, text):
        """Character spans [start, end) in `text` of what each assistant turn generates, eos included.

        A turn starts after its role header, the first line of the template's generation prompt
        ("<|im_start|>assistant\\n"), searched from where the conversation before the turn ends, and
        runs to the first eos after it (within the turn as rendered alone, where that is a prefix).
        """
        eos, spans, cursor = self.tokenizer.eos_token, [], 0
        default_header = f"{self.tokenizer.bos_token}assistant\n"
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:k], tools)
            prompt = self._render(messages[:k], tools, add_generation_prompt=True)
            turn = self._render(messages[:k + 1], tools)
            header = default_header
            if before is not None and text.startswith(before):
                cursor = max(cursor, len(before))
                if prompt is not None and prompt.startswith(before) and len(prompt) > len(before):
                    first_line, newline, _ = prompt[len(before):].partition("\n")
                    header = first_line + newline
            start = text.find(header, cursor)
            if start < 0:
                raise ValueError(f"assistant message {k} not found in the chat template output")
            start += len(header)
            bound = len(turn) if turn is not None and text.startswith(turn) and len(turn) > start else len(text)
            eos_pos = text.find(eos, start, bound)
            end = eos_pos + len(eos) if eos_pos >= 0 else len(text[:bound].rstrip())
            spans.append((start, end))
            cursor = end
        return spans

    def _tokenized_chunks(self, records, bad_lines):
        texts, spans = [], []
        for lineno, value, error in records:
            if not error:
                try:
                    messages, tools = _chat_messages(value)
                except ValueError as e:
                    error = str(e)
            if not error:
                try:
                    text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
                    spans.append(self._assistant_spans(messages, tools, text))
                    texts.append(text)
                except Exception as e:  # a template may reject e.g. an unexpected role order
                    error = f"cannot apply the chat template ({e})"
            if error:
                bad_lines(lineno, error)
                continue
            if len(texts) == CHUNK_DOCS:
                yield self._encode(texts, spans)
                texts, spans = [], []
        if texts:
            yield self._encode(texts, spans)

    def _encode(self, texts, spans):
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for ids, offsets, doc_spans in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
            starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            mask = np.zeros(len(ids), dtype=np.uint8)
            for a, b in doc_spans:
                mask |= (starts >= a) & (starts < b)  # a token is labelled if it starts inside the span
            out.append((ids, mask))
        return out

    def __len__(self):
        return len(self.row_offsets) - 1 if self.packing else self.num_conversations

    def _conversation(self, index):
        """(ids, labels) of conversation `index`, truncated to max_length."""
        tokens, mask = self._arrays()
        a, b = self.offsets[index], min(self.offsets[index + 1], self.offsets[index] + self.max_length)
        ids = np.asarray(tokens[a:b], dtype=np.int64)
        return ids, np.where(mask[a:b] > 0, ids, -100)

    def _packed_row(self, index):
        """Packed row `index`: its conversations back to back, then padding; per-conversation positions."""
        parts = [self._conversation(d) for d in self.row_docs[self.row_offsets[index]:self.row_offsets[index + 1]]]
        for _, labels in parts:
            labels[0] = -100  # the shift would make it the previous conversation's last target
        ids = np.concatenate([p[0] for p in parts])
        input_ids, labels = self._padded(ids, np.concatenate([p[1] for p in parts]))
        if not self.doc_mask:
            return input_ids, labels
        # 0, 1, ... per conversation, and for the padding after them (a document of its own)
        sizes = [len(p[0]) for p in parts] + ([self.max_length - len(ids)] if len(ids) < self.max_length else [])
        return input_ids, labels, torch.from_numpy(np.concatenate([np.arange(n) for n in sizes]))

    def __getitem__(self, index):
        if self.packing:
            return self._packed_row(index)
        ids, labels = self._conversation(index)
        return self._padded(ids, labels)


# ----------------------------------------------------------------------------- preference pairs (DPO)

class _PreferenceSide(SFTDataset):
    """One side ("chosen" or "rejected") of a preference file, rendered and labelled as SFT conversations.

    Every row gives one document: a row that is bad on this side becomes an empty document when bad rows are
    skipped, so the two sides of a file stay aligned row by row.
    """

    def __init__(self, field, data_path, tokenizer, **kwargs):
        self.field, self.kind = field, f"dpo_{field}"
        super().__init__(data_path, tokenizer, **kwargs)

    def _tokenized_chunks(self, records, bad_lines):
        run = []
        for record in records:
            run.append(record)
            if len(run) == CHUNK_DOCS:
                yield self._aligned(run, bad_lines)
                run = []
        if run:
            yield self._aligned(run, bad_lines)

    def _aligned(self, run, bad_lines):
        """SFT's documents of `run`, an empty one in place of each bad row (bad_lines raises unless skipping)."""
        failed = set()

        def report(lineno, error):
            bad_lines(lineno, error)
            failed.add(lineno)
        docs = iter([doc for chunk in SFTDataset._tokenized_chunks(self, iter(run), report) for doc in chunk])
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8))
        return [empty if lineno in failed else next(docs) for lineno, _, _ in run]

    def row_lengths(self):
        return np.diff(self.offsets)


class DPODataset(Dataset):
    """Preference pairs, MiniMind's dpo.jsonl ({"chosen": [messages], "rejected": [messages]}, JSONL or parquet).

    Each side is rendered and labelled as an SFT conversation (assistant tokens only, tools and reasoning
    included), from a token cache per side. An item is one pair, chosen first: (input_ids (2, L), labels (2, L)),
    plus the reference model's summed log-probs (2,) once set_reference() gave them (trainer/dpo.py), so a
    pair always travels in one sample. Rows bad on either side are skipped with --skip_bad_lines, else reported.
    """

    def __init__(self, data_path, tokenizer, max_length=1024, skip_bad_lines=False, cache_dir=None, num_proc=None,
                 part=(0, 1)):
        data_path = os.fspath(data_path)
        if data_path.endswith(SHARD_SUFFIX):
            raise ValueError(f"{data_path}: DPO reads JSONL or parquet rows with 'chosen' and 'rejected', "
                             "not a pretokenized shard")
        kwargs = dict(max_length=max_length, skip_bad_lines=skip_bad_lines, cache_dir=cache_dir, num_proc=num_proc,
                      part=part)
        self.chosen = _PreferenceSide("chosen", data_path, tokenizer, **kwargs)
        self.rejected = _PreferenceSide("rejected", data_path, tokenizer, **kwargs)
        if len(self.chosen) != len(self.rejected):
            raise ValueError(f"{data_path}: the chosen and rejected caches differ in rows; delete them under "
                             f"{os.path.dirname(self.chosen.cache_path)}")
        self.data_path, self.max_length = data_path, max_length
        self.pairs = np.flatnonzero((self.chosen.row_lengths() > 0) & (self.rejected.row_lengths() > 0))
        self.num_bad_lines = len(self.chosen) - len(self.pairs)
        if len(self.pairs) == 0:
            raise ValueError(f"{data_path}: no pair with both 'chosen' and 'rejected' usable")
        self.reference = None

    def cache_key(self):
        """What the pairs' tokens depend on: both token caches (file, tokenizer) and the row length."""
        return [self.chosen.cache_path, self.rejected.cache_path, self.max_length]

    def set_reference(self, log_probs):
        """The reference model's summed log-probs of every pair, shape (len(self), 2): chosen, rejected."""
        log_probs = np.asarray(log_probs, dtype=np.float32)
        if log_probs.shape != (len(self), 2):
            raise ValueError(f"reference log-probs of shape {log_probs.shape}, expected {(len(self), 2)}")
        self.reference = log_probs

    def no_target_line(self):
        """The one info line about sides without an assistant token within max_length; None when every row has one."""
        counts = [(side.field, side.num_rows_without_targets - (len(side) - int((side.row_lengths() > 0).sum())))
                  for side in (self.chosen, self.rejected)]
        if not any(n for _, n in counts):
            return None
        return (f"{', '.join(f'{n} {field}' for field, n in counts)} of {len(self)} pairs of {self.data_path} have "
                f"no assistant token within --max_seq_len {self.max_length}; their log-prob is 0")

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        row = int(self.pairs[index])
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = self.chosen[row], self.rejected[row]
        pair = torch.stack([chosen_ids, rejected_ids]), torch.stack([chosen_labels, rejected_labels])
        if self.reference is None:
            return pair
        return (*pair, torch.from_numpy(self.reference[index]))
