"""Anthropic's Messages API, run by the chat handler: the request converted, the answer and its events shaped."""
