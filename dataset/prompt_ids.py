"""A generation prompt's token ids (the server, the web chat, the tool-call eval, the samples logged in training, the
RL prompts and the agent's observations start from them): the text's own tokens, as every stock consumer
(transformers, vLLM, SGLang, llama.cpp, Ollama) tokenizes the rendered prompt. SFT cuts its rows where a generation
prompt ends and tokenizes the pieces apart (dataset/chat.py), so these are the tokens it trained on."""


def prompt_ids(tokenizer, text):
    """The ids of a generation prompt's text, as transformers' apply_chat_template(tokenize=True) gives them."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
