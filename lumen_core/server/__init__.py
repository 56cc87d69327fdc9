"""``lumen serve``: OpenAI- and Anthropic-compatible HTTP APIs over one loaded engine (fastapi + uvicorn)."""
