"""Quantization math and on-disk schemas (dtypes, Gemma 4 config facts, quantization configs); torch only."""
