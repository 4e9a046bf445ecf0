"""Images in chat requests for vision-language models: decoding, URL policy, and the processor's prompts."""
