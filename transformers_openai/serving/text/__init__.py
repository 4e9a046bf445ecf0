"""Text serving: chat and completions, the Responses API and its store, tool calls, structured outputs."""
