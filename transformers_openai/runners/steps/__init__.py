"""Steps of fixed shapes: persistent step buffers, CUDA graphs and CPU-compiled decode steps kept on disk, and the
device side of a step that every tensor-parallel rank runs."""
