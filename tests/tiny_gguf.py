"""Tiny GGUF files for the llama.cpp backend's tests: a seeded transformers model of tests/helpers.py
written out with the `gguf` package (llama and qwen2 architectures; f32, q8_0, or "k": Q4_K and Q6_K as in
Q4_K_M, with hidden sizes a multiple of 256) and a byte-level
vocabulary, so that llama.cpp and transformers run the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers import BYTE_VOCAB, byte_tokenizer, tiny_transformer

from speculant.kernels.formats import quantize_q4_k, quantize_q6_k

GGUF_ARCHS = ("llama", "qwen2")


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's llama rotates interleaved pairs where transformers rotates halves: reorder q/k rows."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_tiny_gguf(path: Path, arch: str, seed: int, quant: str = "q8_0", layers: int = 2, hidden: int = 64,
                    window: int | None = None):
    """Write the tiny model `tiny_transformer(arch, seed, BYTE_VOCAB)` as a GGUF file (with `window`, keys
    beyond a sliding window of that many positions are hidden, as Mistral's); return the model."""
    import gguf

    model = tiny_transformer(arch, seed, BYTE_VOCAB, init_std=0.1, layers=layers, hidden=hidden)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters")
                              else config.rope_theta)
    if window is not None:
        writer.add_sliding_window(window)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "k": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant])
    tokenizer = byte_tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<eos>" else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(vocab["<eos>"])
    writer.add_bos_token_id(vocab["<eos>"])
    writer.add_add_bos_token(False)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            module, kind = ".".join(parts[2:-1]), parts[-1]
            out = f"blk.{parts[1]}.{names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                data = _permute(data, heads if module == "self_attn.q_proj" else kv_heads)
        else:
            out = f"{names[parts[0]]}.{parts[-1]}"
        if quant == "q8_0" and data.ndim == 2 and out != "token_embd.weight":
            writer.add_tensor(out, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif quant == "k" and data.ndim == 2 and out != "token_embd.weight":  # Q4_K_M's mix
            six = out.endswith(("attn_v.weight", "ffn_down.weight", "output.weight"))
            writer.add_tensor(out, (quantize_q6_k if six else quantize_q4_k)(data),
                              raw_dtype=gguf.GGMLQuantizationType.Q6_K if six else gguf.GGMLQuantizationType.Q4_K)
        else:
            writer.add_tensor(out, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
