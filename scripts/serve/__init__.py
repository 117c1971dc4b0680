"""The OpenAI-compatible chat server as a package: requests.py (what it accepts, each refusal OpenAI's error object),
engine.py (one generation at a time, a bounded queue), replies.py (whole or streamed replies in OpenAI's shapes) and
app.py (the FastAPI routes and uvicorn's server); scripts/serve_openai_api.py is its entry. Imports scripts/inference/,
model/ and dataset/, never the trainer."""
