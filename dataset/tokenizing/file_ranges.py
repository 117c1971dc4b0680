"""Ranges of a JSONL or parquet file and their records, for the token cache's parallel build.

A range is (start, end) in bytes for JSONL (start aligned to a line start) and in row groups for parquet; a record is
(line or row number within its range, the value of the field, an error or None).
"""
import json
import os


def is_parquet(path):
    return path.endswith(".parquet")


def extent(path):
    """The whole file as a range: (0, size in bytes), or (0, row groups) for parquet."""
    if is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        return 0, pq.ParquetFile(path).num_row_groups
    return 0, os.path.getsize(path)


def split_range(path, start, end, pieces):
    """`pieces` consecutive ranges covering [start, end), JSONL boundaries moved to the next line start."""
    cuts = [start + (end - start) * i // pieces for i in range(pieces + 1)]
    if not is_parquet(path):
        with open(path, "rb") as f:
            for i in range(1, pieces):
                if cuts[i] > 0:
                    f.seek(cuts[i] - 1)
                    f.readline()  # to the end of the line holding byte cuts[i] - 1
                    cuts[i] = min(max(f.tell(), cuts[i - 1]), end)
    return list(zip(cuts[:-1], cuts[1:]))


def lines_before(path, start):
    """Lines (rows) of the file before `start`: turns a line number within a range into one in the file."""
    if is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        metadata = pq.ParquetFile(path).metadata
        return sum(metadata.row_group(i).num_rows for i in range(start))
    count = 0
    with open(path, "rb") as f:
        while start > 0:
            block = f.read(min(start, 1 << 24))
            count += block.count(b"\n")
            start -= len(block)
    return count


def iter_records(path, field, start, end):
    """Yield (line or row number within the range, 1-based; value of `field`; error or None) per record."""
    if is_parquet(path):
        import pyarrow.parquet as pq  # optional dependency: only for parquet corpora
        parquet_file = pq.ParquetFile(path)
        if field not in parquet_file.schema_arrow.names:
            raise ValueError(f"{path}: parquet file has no '{field}' column")
        row = 0
        if start >= end:
            return
        for batch in parquet_file.iter_batches(columns=[field], row_groups=range(start, end)):
            for value in batch.column(0).to_pylist():
                row += 1
                yield row, value, None if value is not None else f"'{field}' is null"
        return
    with open(path, "rb") as f:  # bytes, so a bad UTF-8 line is reported with its number, too
        f.seek(start)
        position, lineno = start, 0
        while position < end:
            line = f.readline()
            if not line:
                break
            position, lineno = position + len(line), lineno + 1
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) are not records
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                yield lineno, None, f"malformed JSON ({e})"
                continue
            if not isinstance(record, dict) or field not in record:
                yield lineno, None, f"no '{field}' field"
                continue
            yield lineno, record[field], None


class BadLines:
    """Raises `file:line: error` (line numbered in the whole file) on a bad record, or counts it when skipping."""

    def __init__(self, path, skip, start=0):
        self.path, self.skip, self.start, self.count = path, skip, start, 0

    def __call__(self, lineno, error):
        if not self.skip:
            raise ValueError(f"{self.path}:{lines_before(self.path, self.start) + lineno}: {error}")
        self.count += 1
