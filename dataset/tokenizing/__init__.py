"""The tokenizing path: a file's records and byte ranges (file_ranges.py), the worker processes (tokenize_pool.py) and
the token cache's build (token_cache.py), loaded by dataset/shards.py on a cache miss. Imports dataset/ only."""
