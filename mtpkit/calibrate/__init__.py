"""Forward passes over calibration text that yield activation and KV-cache scales, and quantization reports.

Sits above loader/ and runtime/ (it runs the model) and hands plain numbers to convert/ (which writes them).
"""
