"""The backends: each a CausalLM on its own numerics, declaring its `Capabilities` (see models/base.py): `lean`
(GGUF on speculant's 4-bit kernels), `llamacpp` (GGUF on ggml, and the native build it runs on), `hf`
(transformers on batch-invariant linears) and `static` (torch, a static cache, compiled)."""
