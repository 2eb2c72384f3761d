"""Glue from configs and tensors to runtime objects (`load_pair`); built on convert/ and runtime/."""
