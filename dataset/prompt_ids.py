"""A generation prompt's token ids as training saw the same text (the server, the web chat, the tool-call eval, the
samples logged in training, the RL prompts and the agent's observations start from them)."""


def prompt_ids(tokenizer, text):
    """The ids of a generation prompt as training tokenizes the same text once the reply follows it.

    A byte-level pre-tokenizer splits trailing whitespace by what comes next: MiniMind's tokenizer reads the end of
    "...</think>\\n\\n" as one "\\n\\n" token, but "...</think>\\n\\nHello" (what SFT trained on) as "\\n", "\\n". Fed
    the first, a model trained on the second continues as after "<think>\\n\\n" and writes "</think>" again. So the
    prompt is tokenized with a letter after it and the letter's token dropped; where that does not give back exactly
    `text` (a trailing space joins the letter), the plain tokenization is kept.
    """
    if text != text.rstrip():
        probe = tokenizer(text + "A", add_special_tokens=False)["input_ids"][:-1]
        if tokenizer.decode(probe, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text:
            return probe
    return tokenizer(text, add_special_tokens=False)["input_ids"]
