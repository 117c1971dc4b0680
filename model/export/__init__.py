"""The export formats for other runtimes: GGUF for llama.cpp (gguf.py) and the Ollama Modelfile beside it (ollama.py),
written by scripts/convert_model.py. Imports model/ only."""
