"""The HTTP side: the OpenAI-compatible app and its routes, the request schema, responses and streaming, the
chat format, media parts, tokenizers and incremental detokenization."""
