"""/v1/rerank and /v1/score: text pairs scored by a cross-encoder, or by an embedding model's cosine similarity."""
