"""Model runners: one per model kind, each owning the model's forward passes and its batched KV state."""
