"""The frozen MiniLM text backbone and the Enhancer groups and prototype selector built on it."""
