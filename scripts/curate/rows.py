"""The input rows of scripts/curate_data.py: datatrove's JSONL and parquet readers made strict (a row that is not a
JSON object, not UTF-8, not JSON, or has no text raises BadRow naming the file and the row; datatrove's own readers
skip such a row with a warning, or stop reading the file at a byte that is not UTF-8), and the adapters that keep each
input row as it was."""
import os

import orjson
from datatrove.data import Document
from datatrove.pipeline.readers import JsonlReader, ParquetReader


class BadRow(ValueError):
    """An input row the curation cannot read: the message names the file and the row (1-based)."""

    @classmethod
    def at(cls, path, index, reason, fix="fix or remove that row"):
        return cls(f"{os.path.join('/', path)} row {index + 1}: {reason}; {fix}")


def parsed_line(path, index, line):
    """The JSON object on one line (bytes), or BadRow saying why it is not one."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise BadRow.at(path, index, f"byte 0x{line[bad.start]:02x} at column {bad.start + 1} is not UTF-8")
        raise BadRow.at(path, index, f"not valid JSON ({e})")
    if not isinstance(data, dict):
        raise BadRow.at(path, index, f"a JSON {type(data).__name__}, not an object")
    return data


class WithoutDocStats:
    """Leaves out datatrove's per-document length statistic (doc_len, updated by every reader, filter and writer for
    every document it passes, ~10 us a call); the report counts documents and characters with steps.Tally."""

    def update_doc_stats(self, document):
        pass


class StrictRows(WithoutDocStats):
    """get_document_from_dict without datatrove's skip of rows whose text is empty: every row read is a document, so
    the report's input count is the rows read (an empty text is then dropped, and counted, as too short)."""

    def get_document_from_dict(self, data, source_file, id_in_file):
        return Document(**self.adapter(data, source_file, id_in_file))


class RowReader(StrictRows, JsonlReader):
    """datatrove's JsonlReader, strict: BadRow at the first line that is not a JSON object; blank lines skipped."""

    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rb", compression=self.compression) as f:
            for index, line in enumerate(f):
                if line.strip():  # no timer call a line (datatrove's costs ~10 us): the report does not read it
                    yield self.get_document_from_dict(parsed_line(filepath, index, line), filepath, index)


class ParquetRowReader(StrictRows, ParquetReader):
    """datatrove's ParquetReader, every row a document (the adapter raises BadRow for a row without text)."""


def conversation_text(path, index, row):
    """The text of an SFT row: each message's content (and reasoning), one per line."""
    messages = row.get("conversations")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRow.at(path, index, 'no "conversations" list of messages')
    parts = []
    for message in messages:
        for field in ("reasoning_content", "content"):
            if isinstance(message.get(field), str) and message[field]:
                parts.append(message[field])
    return "\n".join(parts)


def row_from_file(self, data: dict, path: str, id_in_file):
    """Reader adapter: the text to curate (the text field, or the conversation's messages) and the row as it was."""
    if self.text_key == "conversations":
        text, row = conversation_text(path, id_in_file, data), data
    else:
        row = dict(data)
        text = row.pop(self.text_key, None)
        if not isinstance(text, str):
            fields = ", ".join(sorted(data)) or "none"
            raise BadRow.at(path, id_in_file, f'no text in field "{self.text_key}" (its fields: {fields})',
                            "--text_field names the text's field; or fix that row")
    return {"text": text, "id": f"{path}/{id_in_file}",
            "metadata": {"row": row, "text_key": None if self.text_key == "conversations" else self.text_key}}


def row_for_output(self, document: Document) -> dict:
    """Writer adapter: the input row unchanged (its text field first), datatrove's own fields left out."""
    text_key, row = document.metadata["text_key"], document.metadata["row"]
    return {text_key: document.text, **row} if text_key else row
