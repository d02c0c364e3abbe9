"""OpenAI's API: its request shapes (`schemas`, `tool_specs`, and the fields of peer servers,
`peer_fields`), its reply shapes (`replies`), and its routes' answers: chat completions
(`chat`), text completions (`completions`) and embeddings (`embeddings`)."""
