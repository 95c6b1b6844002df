"""The CPU harness: a real SGLang 0.5.23 server on a machine without a GPU.

`install` puts SGLang into an isolated venv with the import shims of `shim`,
`model` makes the tiny dummy-weight Llama it serves, and `serve` starts and stops
the server (`CpuServer`). See docs/cpu-harness.md.
"""
