"""Chat rows into the text and labels SFT trains on: MiniMind-3's messages normalised (chat_messages), rendered with
the tokenizer's chat template (render_chat), and the assistant's own tokens found in the rendering (assistant_spans,
labelled_tokens), and SFTDataset, the chat rows on the token cache. Used by DPODataset (dataset/preference_data.py)
and RLAIFDataset too.

What SFT labels: exactly what the assistant generates after its role header, in every assistant turn:
    <think>\n{reasoning_content}\n</think>\n\n{content}<tool_call>...</tool_call><|im_end|>
that is the reasoning with its think tags (an empty think block where there is no reasoning, as
MiniMind-3's template renders it), the content, the tool calls, and the eos closing the turn.
Not labelled: the system prompt and tools schema, user turns, tool responses (rendered as user turns:
they come from the environment, not the model), the role header "<|im_start|>assistant\n" (the prompt
supplies it), the "\n" after <|im_end|> (generation stops at eos) and padding. Why: the loss is the
model's own output given everything it is shown, so it learns to reason, answer, call tools and stop.
Unlike MiniMind, empty think blocks are never dropped at random: the cache is a pure function of the file.

How it is tokenized: as every stock consumer (transformers, vLLM, SGLang, llama.cpp, Ollama) tokenizes the prompt
that asks for that turn. A byte-level pre-tokenizer splits whitespace by what follows it: the generation prompt
"...<think>\n\n</think>\n\n" alone ends in one "\n\n" token, the same text with the answer after it in "\n", "\n".
Trained on the second and prompted with the first, a model took the "\n\n" for the inside of a think block and wrote
"</think>" again. So the text is cut after each turn's generation prompt where the turn begins with it (an empty think
block) and the pieces are tokenized apart (labelled_tokens). In a conversation of several turns a stock prompt's
history still reads the earlier turns' "\n\n" as two tokens: only the turn being answered ends as trained.
"""
import json

import numpy as np
import torch

from dataset.packing import pack_conversations
from dataset.shards import CHUNK_DOCS, TokenCacheDataset

SCAN_TOKENS = 1 << 26  # mask bytes read per block when counting rows without targets: bounded memory


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


def chat_messages(value, field="conversations"):
    """(messages, tools) for apply_chat_template from one `field` value (SFT's 'conversations', DPO's 'chosen' or
    'rejected'); ValueError says what is wrong, naming that field.

    Null fields are dropped (parquet and `datasets` fill absent ones with null); a missing content is "";
    'tools' (on any message, MiniMind-3 puts it on the system one) and 'tool_calls' are decoded from JSON.
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"'{field}' must be a non-empty list of messages")
    messages, tools = [], None
    for i, raw in enumerate(value):
        if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
            raise ValueError(f"message {i} of '{field}' needs a string 'role'")
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


def render_chat(tokenizer, messages, tools, add_generation_prompt=False):
    """Chat template text of `messages`, or None where the template rejects the partial list."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception:
        return None


def assistant_spans(tokenizer, messages, tools, text):
    """(spans, cuts): character spans [start, end) in `text` of what each assistant turn generates, eos included, and
    where each turn's generation prompt ends in `text` (the turns that begin with the whole prompt: an empty think
    block), which labelled_tokens tokenizes as a prompt's end.

    A turn starts after its role header, the first line of the template's generation prompt
    ("<|im_start|>assistant\\n"), searched from where the conversation before the turn ends, and
    runs to the first eos after it (within the turn as rendered alone, where that is a prefix).
    """
    eos, spans, cuts, cursor = tokenizer.eos_token, [], [], 0
    default_header = f"{tokenizer.bos_token}assistant\n"
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:k], tools)
        prompt = render_chat(tokenizer, messages[:k], tools, add_generation_prompt=True)
        turn = render_chat(tokenizer, messages[:k + 1], tools)
        header = default_header
        if before is not None and text.startswith(before):
            cursor = max(cursor, len(before))
            if prompt is not None and prompt.startswith(before) and len(prompt) > len(before):
                first_line, newline, _ = prompt[len(before):].partition("\n")
                header = first_line + newline
                if text.startswith(prompt):
                    cuts.append(len(prompt))
        start = text.find(header, cursor)
        if start < 0:
            raise ValueError(f"assistant message {k} not found in the chat template output")
        start += len(header)
        bound = len(turn) if turn is not None and text.startswith(turn) and len(turn) > start else len(text)
        eos_pos = text.find(eos, start, bound)
        end = eos_pos + len(eos) if eos_pos >= 0 else len(text[:bound].rstrip())
        spans.append((start, end))
        cursor = end
    return spans, cuts


def labelled_tokens(tokenizer, texts, spans, cuts=None):
    """(ids, loss mask) per text: each text tokenized in pieces cut at its `cuts` (character positions: where a
    generation prompt ends), and a token labelled where it starts inside one of the text's assistant spans."""
    cuts = cuts or [[] for _ in texts]
    bounds = [[0, *sorted(c for c in set(doc_cuts) if 0 < c < len(text)), len(text)]
              for text, doc_cuts in zip(texts, cuts)]
    pieces = [text[a:b] for text, doc in zip(texts, bounds) for a, b in zip(doc, doc[1:])]
    encoded = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True)
    out, piece = [], 0
    for doc, doc_spans in zip(bounds, spans):
        ids, starts = [], []
        for begin in doc[:-1]:  # the pieces of this text, their offsets moved to the text's
            ids += encoded["input_ids"][piece]
            starts += [begin + a for a, _ in encoded["offset_mapping"][piece]]
            piece += 1
        starts = np.asarray(starts, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in doc_spans:
            mask |= (starts >= a) & (starts < b)  # a token is labelled if it starts inside the span
        out.append((ids, mask))
    return out


def longer_rows(cache, rows, max_length):
    """How many of `rows` of an SFT cache (a DPO side) hold more than max_length tokens."""
    return int((np.diff(cache.offsets)[rows] > max_length).sum())


# ----------------------------------------------------------------------------- the SFT dataset

class SFTDataset(TokenCacheDataset):
    """Chat data ({"conversations": [message, ...]} JSONL or parquet) rendered with the chat template.

    Messages are MiniMind-3's: role, content, and optionally reasoning_content, tools (the function
    schemas, on the system message) and tool_calls (on assistant messages), the last two as lists or
    as JSON strings. The schemas go to apply_chat_template(tools=...), so the template renders them.
    Labelling is described in dataset/chat.py.

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

    def notes(self):
        """The info lines about what this dataset loses at max_length (the trainer prints them at the start)."""
        return [line for line in (self.no_target_line(), self.truncation_line()) if line]

    def truncation_line(self):
        """How many conversations are longer than --max_seq_len: they are cut at its end, and their answers with it."""
        cut = longer_rows(self, slice(None), self.max_length)
        if not cut:
            return None
        return (f"{cut} of {self.num_conversations} conversations of {self.data_path} are longer than --max_seq_len "
                f"{self.max_length}: cut, their answers lose the end")

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

    def _tokenized_chunks(self, records, bad_lines):
        texts, spans, cuts = [], [], []
        for lineno, value, error in records:
            if not error:
                try:
                    messages, tools = chat_messages(value, self.field)
                except ValueError as e:
                    error = str(e)
            if not error:
                try:
                    text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
                    doc_spans, doc_cuts = assistant_spans(self.tokenizer, messages, tools, text)
                    spans.append(doc_spans)
                    cuts.append(doc_cuts)
                    texts.append(text)
                except Exception as e:  # a template may reject e.g. an unexpected role order
                    error = f"cannot apply the chat template ({e})"
            if error:
                bad_lines(lineno, error)
                continue
            if len(texts) == CHUNK_DOCS:
                yield labelled_tokens(self.tokenizer, texts, spans, cuts)
                texts, spans, cuts = [], [], []
        if texts:
            yield labelled_tokens(self.tokenizer, texts, spans, cuts)

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
