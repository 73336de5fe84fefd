"""The HTTP side: the OpenAI-compatible app and its routes, the guards every request passes (body limit, Host
check, JSON errors), the request schema, responses and streaming, the chat format, media parts, tokenizers and
incremental detokenization."""
