"""The inference library: load weights + tokenizer (load.py), the flags that name them (flags.py), render a chat and
generate or stream (generate.py). Used by eval_llm, the server (scripts/serve/), web_demo, eval_toolcall and eval_bench.
Imports model/ and dataset/ only: never the trainer's plan, runtime or checkpoint code (a resume checkpoint's reader,
trainer/ckpt/resume.py, loads only when --checkpoint names one); tests/test_rooms.py checks it."""
