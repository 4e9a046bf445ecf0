"""The runners' K/V tensors: the paged pool and the caches stock transformers forwards see, block tables as the
engine hands them over, and encoder-decoder cross-attention K/V."""
