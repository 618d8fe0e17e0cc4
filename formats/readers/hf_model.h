// A Hugging Face Llama-family checkpoint directory opened for conversion to `.llmq`.
#pragma once
#include <string>

#include "formats/readers/llama2c.h"  // SourceModel

namespace llmq {

/// Opens a Hugging Face checkpoint directory (transformers' save_pretrained layout):
///
///  * `config.json`: `model_type` "llama", "mistral" or "qwen2" (or, without model_type,
///    `architectures[0]` LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM); required
///    keys hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size,
///    max_position_embeddings, rms_norm_eps; optional num_key_value_heads (default: heads),
///    head_dim (default hidden_size / heads), rope_theta (10000), tie_word_embeddings (false),
///    hidden_act (must be "silu"), mlp_bias (must be false), rope_scaling (must be null:
///    "not supported yet"). A Mistral sliding_window shorter than max_position_embeddings
///    caps the context length at the window (full attention is exact up to it).
///  * tensors from `model.safetensors`, or from the shards named by the `weight_map` of
///    `model.safetensors.index.json` (each a plain file name in the directory; every tensor
///    must be in the shard the map names). Dtypes F32, F16 and BF16.
///  * names mapped to ours (models/config.h): model.embed_tokens.weight -> token_embd.weight;
///    model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
///    mlp.{gate,up,down}_proj}.weight -> blk.N.{attn_norm, attn_q, attn_k, attn_v,
///    attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}.weight; model.norm.weight ->
///    output_norm.weight; lm_head.weight -> output.weight (ignored when the embeddings are
///    tied); attention biases self_attn.{q,k,v,o}_proj.bias -> blk.N.attn_{q,k,v,output}.bias
///    (Qwen2 has q/k/v; Llama with attention_bias all four): any of them sets
///    config.attn_qkv_bias / attn_out_bias and then every layer must have them.
///    `...rotary_emb.inv_freq` buffers are ignored; any other tensor is a FileError.
///  * q/k rows stay in HF's order (HF's Llama conversion permutes Meta's interleaved rows so
///    RoPE rotates pairs (i, i + head_dim/2)): config.rope_layout = RotateHalf.
///  * the tokenizer, chat template and special ids (formats/readers/hf_tokenizer.h); has_vocab is false
///    when the directory holds no tokenizer file.
///
/// Every expected tensor must be present with the exact shape the config implies. Tensors
/// stored as F32/F16/BF16 are offered raw (a lossless byte copy); read() converts one tensor to
/// fp32 from the mapping, so nothing holds the whole model in memory.
/// Throws FileError naming the file at fault (config.json, the index, a shard, a tokenizer
/// file) and the fault.
SourceModel read_hf_model(const std::string& dir);

/// Provenance hash of a checkpoint directory (for `general.source.xxh64`, where a single file
/// gets the XXH64 of its bytes): XXH64 (seed 0), streamed, over the directory's regular files
/// named *.json, *.safetensors, *.model or *.jinja (not recursing), in byte order of their
/// names; per file: the name, one zero byte, its size as u64 little-endian, its bytes.
/// Returned as 16 lower-case hex digits. Throws FileError when a file cannot be read.
std::string hf_checkpoint_xxh64(const std::string& dir);

}  // namespace llmq
