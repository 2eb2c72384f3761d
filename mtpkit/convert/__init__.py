"""Files in, files out: checkpoint I/O, config rules, quantize, pair, check."""
