"""LoRA adapters served beside their base model: read from PEFT's format, applied per group of rows in one batch."""
