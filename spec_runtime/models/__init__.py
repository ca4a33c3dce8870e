"""Model families and their loading: the registry (model_type -> class), one file per
family built from spec_runtime.layers, the HF config parser (ModelArch), and the
loader for HF directories and GGUF files."""
