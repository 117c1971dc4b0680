"""RLAIFDataset (MiniMind's): the prompts the RL stages generate from, MiniMind's rlaif.jsonl format.

A row is {"conversations": [message, ...], ...other columns}; the prompt is the conversation without its last
message when that is the assistant's (a reference answer, never trained on), rendered by the chat template with the
generation prompt. MiniMind opens the think block in a share of the prompts (--thinking_ratio): the template's
`open_thinking` ends the prompt with "<think>\\n" (the model writes its reasoning) instead of an empty think block.
Which rows open it is drawn once from the seed, so the prompts are a pure function of (file, seed).

An item is (prompt ids (max_length,) left-padded with the pad id, its length, the row as JSON text): the row's
other columns, its prompt messages ("prompt") and the tools it offers ("tools", where it offers any) reach the reward
functions (TRL's convention). A prompt longer than
max_length keeps its last max_length tokens, as MiniMind's (counted: RLAIFDataset.notes says how many). Given the
mock tools (the agent stage), rows offering a tool they lack are counted too. JSONL or parquet; rows are read and
tokenized once.
"""
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from dataset.chat import chat_messages
from dataset.prompt_ids import prompt_ids
from dataset.tokenizing.file_ranges import BadLines


def read_rows(path):
    """(line number, row dict or None, error or None) of a JSONL or parquet file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # optional dependency: only for parquet files
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row, None
        return
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                yield lineno, None, f"malformed JSON ({e})"
                continue
            yield lineno, row, None if isinstance(row, dict) else "a row must be a JSON object"


def prompt_messages(conversations):
    """(messages, tools) of a row's prompt: its conversation without a last assistant message."""
    if isinstance(conversations, list) and conversations and isinstance(conversations[-1], dict) \
            and conversations[-1].get("role") == "assistant":
        conversations = conversations[:-1]
    if not isinstance(conversations, list) or not conversations:
        raise ValueError("'conversations' needs a message before the last assistant one (the prompt)")
    # chat_messages checks and normalises a conversation; the empty answer stands for the one to be generated
    messages, tools = chat_messages(list(conversations) + [{"role": "assistant", "content": ""}])
    return messages[:-1], tools


def tool_names(row):
    """The names of the tools a row (its JSON columns) offers."""
    return [tool.get("function", tool).get("name") for tool in row.get("tools") or [] if isinstance(tool, dict)]


def unknown_tool_names(tools, mock_tools):
    """The offered tools' names outside `mock_tools` (none when no mock environment is given)."""
    if mock_tools is None:
        return []
    return [name for name in tool_names({"tools": tools}) if name not in mock_tools]


class RLAIFDataset(Dataset):
    """Prompts of an rlaif.jsonl-style file, tokenized (see the module docstring)."""

    def __init__(self, data_path, tokenizer, max_length=768, thinking_ratio=0.9, seed=42, skip_bad_lines=False,
                 mock_tools=None):
        data_path = os.fspath(data_path)
        if not os.path.isfile(data_path):
            raise FileNotFoundError(f"data file not found: {data_path}")
        self.data_path, self.max_length, self.pad_token_id = data_path, max_length, tokenizer.pad_token_id
        bad_lines = BadLines(data_path, skip_bad_lines)
        texts, self.rows, self.unknown_tools = [], [], {}  # unknown tool name -> rows offering it
        rows = [(lineno, row, error) for lineno, row, error in read_rows(data_path)]
        thinking = np.random.default_rng(seed).random(len(rows)) < thinking_ratio
        for (lineno, row, error), think in zip(rows, thinking):
            try:
                if error:
                    raise ValueError(error)
                if "conversations" not in row:
                    raise ValueError("no 'conversations' field")
                messages, tools = prompt_messages(row["conversations"])
                texts.append(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                           add_generation_prompt=True, open_thinking=bool(think)))
            except ValueError as e:
                bad_lines(lineno, str(e))
                continue
            columns = {key: value for key, value in row.items() if key != "conversations"}
            if tools:  # the tools offered, for the agent stage's mock environment and reward
                columns["tools"] = tools
                for name in unknown_tool_names(tools, mock_tools):
                    self.unknown_tools[name] = self.unknown_tools.get(name, 0) + 1
            self.rows.append(json.dumps(dict(columns, prompt=messages), ensure_ascii=False))
        self.num_bad_lines = bad_lines.count
        if not texts:
            raise ValueError(f"{data_path}: no usable prompt")
        self.prompts = [np.asarray(prompt_ids(tokenizer, text), dtype=np.int64) for text in texts]
        self.num_truncated = sum(len(ids) > max_length for ids in self.prompts)
        self.rows_with_unknown_tools = sum(any(name in self.unknown_tools for name in tool_names(json.loads(row)))
                                           for row in self.rows) if self.unknown_tools else 0

    def notes(self):
        """The info lines about prompts cut to --max_seq_len and tools the mock environment lacks."""
        return [line for line in (self.no_target_line(), self.unknown_tools_line()) if line]

    def no_target_line(self):
        """The one info line about prompts cut to --max_seq_len; None when every prompt fits."""
        if not self.num_truncated:
            return None
        return (f"{self.num_truncated} of {len(self)} prompts of {self.data_path} are longer than --max_seq_len "
                f"{self.max_length}: their start dropped (each keeps its last {self.max_length} tokens)")

    def unknown_tools_line(self):
        """The one info line about rows offering tools the mock environment lacks; None when there are none."""
        if not self.unknown_tools:
            return None
        names = ", ".join(sorted(self.unknown_tools))
        return (f"{self.rows_with_unknown_tools} of {len(self)} prompts of {self.data_path} offer tools the mock "
                f"tools (dataset/tools.py) do not have ({names}): a call to one is answered with an error")

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, index):
        ids = self.prompts[index][-self.max_length:]
        padded = torch.full((self.max_length,), self.pad_token_id, dtype=torch.long)
        padded[self.max_length - len(ids):] = torch.from_numpy(ids)
        return padded, torch.tensor(len(ids)), self.rows[index]
