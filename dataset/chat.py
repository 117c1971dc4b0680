"""Chat rows into the text and labels SFT trains on: MiniMind-3's messages normalised (chat_messages), rendered with
the tokenizer's chat template (render_chat), and the assistant's own tokens found in the rendering (assistant_spans,
labelled_tokens). Used by SFTDataset and DPODataset (dataset/lm_dataset.py) and RLAIFDataset.

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
import json

import numpy as np


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
    """Character spans [start, end) in `text` of what each assistant turn generates, eos included.

    A turn starts after its role header, the first line of the template's generation prompt
    ("<|im_start|>assistant\\n"), searched from where the conversation before the turn ends, and
    runs to the first eos after it (within the turn as rendered alone, where that is a prefix).
    """
    eos, spans, cursor = tokenizer.eos_token, [], 0
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


def labelled_tokens(tokenizer, texts, spans):
    """(ids, loss mask) per text: a token is labelled where it starts inside one of the text's assistant spans."""
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, doc_spans in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
        starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in doc_spans:
            mask |= (starts >= a) & (starts < b)  # a token is labelled if it starts inside the span
        out.append((ids, mask))
    return out
