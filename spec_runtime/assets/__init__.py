"""Files shipped with the package.

smollm2-draft.gguf: the draft distilled from the embedded SmolLM2-135M-Instruct
(`spec-runtime distill`, then `spec-runtime export-gguf`; docs/distill.md), the draft of
`generate` and `serve` when neither --target nor --draft is given.
"""
