"""Speech serving: audio decoding, transcription and translation over 30 s windows (long-form), word timing and the
transcript formats."""
