"""Tiny GGUF files for the llama.cpp and lean backends' tests: a seeded transformers model of tests/helpers.py
written out with the `gguf` package (llama, qwen2, and for the lean backend llama3 with its rope factors, qwen3,
phi3, gemma2 and gemma3; f32, q8_0, "k": Q4_K and Q6_K as in Q4_K_M, with hidden sizes a multiple of 256, or any GGUF type name for
every matrix) and a byte-level vocabulary, so that llama.cpp, the lean backend and transformers run the same
weights."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from helpers import BYTE_VOCAB, byte_tokenizer, tiny_transformer

from speculant.kernels.formats import quantize_q4_k, quantize_q5_k, quantize_q6_k

GGUF_ARCHS = ("llama", "qwen2")


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's llama rotates interleaved pairs where transformers rotates halves: reorder q/k rows."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for Llama 3's rope scaling (theta / factor)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # transformers' modules: llama.cpp's


GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}  # Gemma's norms where llama.cpp names them


def gguf_name(arch: str, name: str) -> tuple[str, bool]:
    """The GGUF tensor of a transformers parameter, and whether its rows are permuted (llama's q and k)."""
    parts = name.removeprefix("model.").split(".")
    if parts[0] != "layers":
        return f"{NAMES[parts[0]]}.{parts[-1]}", False
    module = ".".join(parts[2:-1])
    if arch.startswith("gemma") and module in GEMMA_NAMES:
        return f"blk.{parts[1]}.{GEMMA_NAMES[module]}.{parts[-1]}", False
    permuted = arch in ("llama", "llama3") and module in ("self_attn.q_proj", "self_attn.k_proj")
    return f"blk.{parts[1]}.{NAMES[module]}.{parts[-1]}", permuted


def dequantized_transformer(path: Path, model, arch: str):
    """`model` with the GGUF file's matrices as the backends read them (de-quantized, llama's q/k rows put back in
    transformers' order)."""
    import gguf

    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    state = model.state_dict()
    for name in state:
        out, permuted = gguf_name(arch, name)
        if state[name].ndim != 2 or out not in tensors or out == "token_embd.weight":  # tied heads: the embeddings
            continue
        weight = gguf.quants.dequantize(np.asarray(tensors[out].data), tensors[out].tensor_type).reshape(state[name].shape)
        if permuted:
            n = heads if ".q_proj" in name else kv_heads
            weight = weight.reshape(n, weight.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)
        state[name] = torch.from_numpy(weight.astype(np.float32))
    model.load_state_dict(state)
    return model


def write_tiny_gguf(path: Path, arch: str, seed: int, quant: str = "q8_0", layers: int = 2, hidden: int = 64,
                    window: int | None = None):
    """Write the tiny model `tiny_transformer(arch, seed, BYTE_VOCAB)` as a GGUF file (with `window`, keys
    beyond a sliding window of that many positions are hidden, as Mistral's); return the model."""
    import gguf

    model = tiny_transformer(arch, seed, BYTE_VOCAB, init_std=0.1, layers=layers, hidden=hidden)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if arch in ("llama3", "qwen3", "phi3", "gemma2", "gemma3"):  # norms not all alike, so that one misplaced shows
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                if name.endswith("norm.weight"):
                    tensor.add_(torch.randn_like(tensor) * 0.2)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    rope = rope.get("full_attention", rope)  # Gemma 3: its global layers' (its windowed ones' base is 10000)
    writer = gguf.GGUFWriter(str(path), "llama" if arch == "llama3" else arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
        if config.attn_logit_softcapping:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if window is not None:
        writer.add_sliding_window(window)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "k": gguf.LlamaFileType.MOSTLY_Q4_K_M}.get(quant, gguf.LlamaFileType.GUESSED))
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
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        out, permuted = gguf_name(arch, name)
        if out == "output.weight" and config.tie_word_embeddings:
            continue  # the head is the embeddings
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # Gemma's norms scale by 1 + w: llama.cpp's converter writes 1 + w
        if permuted:
            data = _permute(data, heads if ".q_proj" in name else kv_heads)
        if quant == "q8_0" and data.ndim == 2 and out != "token_embd.weight":
            writer.add_tensor(out, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif quant == "k" and data.ndim == 2 and out != "token_embd.weight":  # Q4_K_M's mix
            six = out.endswith(("attn_v.weight", "ffn_down.weight", "output.weight"))
            writer.add_tensor(out, (quantize_q6_k if six else quantize_q4_k)(data),
                              raw_dtype=gguf.GGMLQuantizationType.Q6_K if six else gguf.GGMLQuantizationType.Q4_K)
        elif quant.upper() == quant and data.ndim == 2 and out != "token_embd.weight":  # a GGUF type name
            writer.add_tensor(out, quantize_q5_k(data) if quant == "Q5_K" else
                              gguf.quants.quantize(data, gguf.GGMLQuantizationType[quant]),
                              raw_dtype=gguf.GGMLQuantizationType[quant])
        else:
            writer.add_tensor(out, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
