// Peak memory of training and fine-tuning a decoder-only transformer, per GPU, line by line:
// parameters, gradients, optimizer states, activations, temporary buffers, framework overhead,
// communication buckets, allocator rounding. Every line carries its formula and its source.
// docs/MEMORY.md lists the formulas; tests/test_mem.cpp reproduces the published figures.
//
// Sources (keys used in the lines' `source`):
//   ZeRO   Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
//          Models", arXiv 1910.02054 (SC'20), §3 and Fig. 1: mixed-precision Adam holds 2Ψ + 2Ψ
//          + KΨ bytes with K = 12, partitioned by stage over N_d data-parallel ranks.
//   KORTH  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
//          arXiv 2205.05198 (MLSys'23), §4 and Table 2: activations per layer.
//   DS     DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs
//          and stage3.py estimate_zero3_model_states_mem_needs (documented in DeepSpeed's
//          "Memory Requirements" page and the transformers DeepSpeed guide).
//   8BIT   Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861.
//   QLORA  Dettmers et al., "QLoRA", arXiv 2305.14314: NF4 blocks of 64 with fp32 absmax, or
//          double quantization (8-bit absmax, blocks of 256): 0.127 bits/parameter of constants.
//   LORA   Hu et al., "LoRA", arXiv 2106.09685: ΔW = B·A with A [r, in], B [out, r].
//   TORCH  PyTorch: torch.optim.AdamW (foreach), torch.amp autocast weight cache,
//          CUDACachingAllocator (512-byte rounding; 2 MiB granularity for large segments),
//          torch.utils.checkpoint, DistributedDataParallel gradient buckets.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mem/report.h"
#include "mem/shape.h"

namespace llmq::mem {

/// Numeric precision of training.
enum class Precision {
  FP32,   ///< fp32 weights, gradients and optimizer states
  Mixed,  ///< fp16/bf16 compute with fp32 master weights (ZeRO/Megatron: 16-bit weights + fp32
          ///< copy; PyTorch framework: fp32 parameters under torch.autocast)
  BF16,   ///< pure bf16: weights, gradients and optimizer states in bf16, no master copy
  Amp,    ///< torch.amp (HF Trainer fp16/bf16=True, accelerate, Lightning 16-mixed): fp32 parameters,
          ///< gradients and optimizer states; each Linear computes from a 16-bit copy of its weight that
          ///< autocast caches until the backward ends; softmax, LayerNorm and the residual stream in fp32
};
/// Optimizer (Adam and AdamW hold the same state).
/// Adafactor: factored second moments (Shazeer & Stern 2018, arXiv 1804.04235, §3), no momentum,
/// as torch.optim.Adafactor keeps them: per matrix [rows, cols] a row and a column vector, per
/// vector parameter a full one, in the parameters' dtype.
enum class Optimizer { Adam, Adam8bit, SGD, SGDMomentum, Adafactor };
/// Activation checkpointing (KORTH §4 / §5).
enum class Checkpointing { None, Selective, Full };
/// Where offloaded tensors go.
enum class Offload { None, Cpu, Nvme };
/// Which implementation the estimate models.
enum class Framework {
  Analytic,   ///< the papers' closed forms (ZeRO, KORTH)
  PyTorch,    ///< single-process PyTorch as bench/train_mem.py runs it (allocator included)
  LitGPT,     ///< LitGPT's finetune scripts (bf16-true), saved tensors of its Block (mem/train_litgpt.cpp)
  DeepSpeed,  ///< DeepSpeed's own estimator formulas for model states (DS), KORTH activations
  TorchTune,  ///< torchtune's single-device recipes (bf16), by phase of the step (mem/train_torchtune.cpp)
  Transformers,  ///< a transformers Llama-family model, full or PEFT LoRA / DoRA, one GPU (mem/train_transformers.cpp)
};

Precision precision_from_name(const std::string& s);      ///< fp32 | fp16 | bf16 | mixed | amp | pure-bf16
Optimizer optimizer_from_name(const std::string& s);      ///< adam | adamw | adam8bit | sgd | sgd-momentum
Checkpointing checkpointing_from_name(const std::string& s);  ///< none | selective | full
Offload offload_from_name(const std::string& s);          ///< none | cpu | nvme
Framework framework_from_name(const std::string& s);      ///< analytic | pytorch | deepspeed | litgpt | torchtune

/// Everything that shapes training memory.
struct TrainOptions {
  Precision precision = Precision::Mixed;
  Optimizer optimizer = Optimizer::Adam;
  int64_t micro_batch = 1;   ///< b: sequences per GPU per forward pass
  int64_t seq_len = 2048;    ///< s
  int64_t grad_accum = 1;    ///< micro-batches per optimizer step (no memory of its own)
  Checkpointing checkpointing = Checkpointing::None;
  bool flash_attention = true;  ///< no s² attention matrices (KORTH: removes 5as²b)
  int64_t lora_rank = 0;        ///< 0: full fine-tuning
  std::vector<std::string> lora_targets = {"q", "k", "v", "o"};  ///< of q k v qkv (fused) o gate up down head, or "all" (not head)
  bool qlora = false;           ///< base weights in NF4 (needs lora_rank > 0)
  bool double_quant = true;     ///< QLoRA double quantization of the absmax constants
  int dp = 1;                   ///< N_d data-parallel ranks (DDP or ZeRO)
  int zero = 0;                 ///< ZeRO stage 0..3 (FSDP FULL_SHARD = 3, SHARD_GRAD_OP = 2)
  /// The sharding is PyTorch FSDP's (--fsdp), not DeepSpeed's: FSDP units (root unit kept
  /// unsharded, one block gathered and one prefetched) instead of DeepSpeed's gathered working
  /// set and gradient bucket.
  bool fsdp = false;
  /// FSDP with the token embedding and the output head as units of their own (torchtune's
  /// custom_sharded_layers; --fsdp-embedding-units): the root unit no longer holds them.
  bool fsdp_embedding_units = false;
  Offload offload_optimizer = Offload::None;
  Offload offload_params = Offload::None;  ///< ZeRO-3 only
  int tp = 1, pp = 1;           ///< tensor- and pipeline-parallel degrees (Megatron)
  bool sequence_parallel = false;
  Framework framework = Framework::Analytic;
  std::string block = "llama";  ///< LitGPT block recipe: llama, gemma, gemma2, phi3, mistral, qwen2, gpt-neox, phi, falcon
  int litgpt_version = 2024;    ///< 2023: lit-gpt 8641822 (RMSNorm in the input dtype); 2024: litgpt 00af8b0d (RMSNorm in fp32)
  double lora_dropout = 0.05;   ///< LoRA dropout p (> 0 keeps a mask and the dropped input per adapted Linear)
  /// PEFT's LoRA on a 16-bit base (--lora-fp32-inputs): get_peft_model's autocast_adapter_dtype
  /// (on by default) keeps the adapters in fp32 and each adapted Linear casts its input to them
  /// (peft/tuners/lora/layer.py, Linear.forward: _cast_input_dtype), so lora_A keeps an fp32
  /// copy of that input for its gradient: 4·s·b·in bytes per adapted Linear and layer.
  bool lora_fp32_inputs = false;
  /// DoRA (--dora; Liu et al., "DoRA", arXiv 2402.09353, as PEFT's use_dora runs it:
  /// src/peft/tuners/lora/dora.py DoraLinearLayer.forward at huggingface/peft d787f51bb): a
  /// trainable magnitude per output feature of every adapted Linear (+Σ out parameters a layer),
  /// and the output m/||W + s·BA||_c · (W x + s·B A x) − W x, whose column norm is detached
  /// (§4.3), so each adapted Linear keeps its base output W x (the compute dtype; with dropout
  /// > 0 recomputed on the dropped input, in the adapters' dtype, together with a copy of W in
  /// that dtype when it is not the parameter itself) and its LoRA output B A x (the adapters'
  /// dtype) for the magnitude's gradient.
  bool dora = false;
  /// --padded, with --framework transformers: batches padded to their longest sequence, so
  /// transformers passes SDPA an attention mask; SDPA then runs its memory-efficient kernel with
  /// the mask as a bias (kept, e·b·s² a layer), and transformers repeats K and V to the query heads
  /// first (integrations/sdpa_attention.py use_gqa_in_sdpa: native GQA only without a mask).
  bool padded = false;
  /// PyTorch release the recipe ran on, "MAJOR.MINOR" ("": a current one). Before 1.11 the
  /// autograd node of softmax kept its input as well as its output (`_softmax_backward_data`
  /// took the input tensor; 1.11 passes only its dtype: pytorch/pytorch#49600 and #65242,
  /// huggingface/transformers#16043), so eager attention keeps every layer's scores twice.
  std::string torch_version;
  std::string gpu;              ///< GPU model, e.g. "H100" (--gpu): sizes PyTorch's cuBLAS workspaces and the measured context
  double cuda_context_bytes = 512.0 * (1 << 20);  ///< assumed, not measured (300-500 MB reported), unless cuda_context_given
  bool cuda_context_given = false;                 ///< --cuda-context: the user measured their setup's context (nvidia-smi after CUDA init)
  double nccl_bytes = 512.0 * (1 << 20);          ///< assumed per process group when world > 1
  // torchtune's memory levers (--framework torchtune)
  bool compile = false;                ///< torch.compile per layer: the fp32 upcasts of RMSNorm and RoPE are recomputed, not kept
  int ce_chunks = 0;                   ///< CEWithChunkedOutputLoss chunks (0: CrossEntropyLoss on the full fp32 logits)
  bool offload_activations = false;    ///< checkpointed activations kept in CPU memory
  bool optimizer_in_backward = false;  ///< each parameter stepped, and its gradient freed, as the backward makes it
  bool paged_optimizer = false;        ///< bitsandbytes paged optimizer: states in CUDA managed memory (not in torch's counters)
};

/// The "NCCL buffers" line of a multi-GPU run: `bytes` (TrainOptions::nccl_bytes), an assumed
/// constant per process group (gpu-other: outside PyTorch's allocator counters).
void add_nccl_line(MemReport& r, double bytes);

/// Bytes PyTorch FSDP (FULL_SHARD, a unit per transformer block) holds unsharded on one GPU
/// beside its shards, gradients not included: the root unit (embeddings, head, final norm; `w`
/// bytes per parameter) from its forward to the end of the backward, plus two blocks (one
/// unsharded, the next prefetched in the backward; their matrices `matrix_bytes` per parameter as
/// stored, e.g. NF4, their norms `w`); with o.fsdp_embedding_units the larger of the head's own
/// unit and a block, plus a block.
/// Sources: FSDP1 torch/distributed/fsdp/_runtime_utils.py (the root handle is not resharded
/// after forward), FSDP2 FSDPState._lazy_init (the root's post_forward_mesh_info = None).
double fsdp_unsharded_bytes(const ModelShape& m, const TrainOptions& o, double w, double matrix_bytes);

/// True for the Hopper data-centre parts (sm_90: H100, H200, H800, H20, GH200), by model name.
bool is_sm90_gpu(const std::string& gpu);

/// One cuBLAS workspace of PyTorch, in bytes: 32 MiB on sm_90 (CUBLAS_WORKSPACE_CONFIG :4096:8),
/// 8 MiB + 128 KiB elsewhere (:4096:2:16:8); PyTorch allocates one per cuBLAS handle and stream
/// from its caching allocator, so they are inside torch.cuda.max_memory_allocated(), and cuBLASLt
/// shares it (unified workspace). Source: PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp
/// (parseChosenWorkspaceSize, getCUDABlasLtWorkspaceSize). A training step holds two: the
/// forward thread's handle and the autograd engine's backward thread's.
double torch_cublas_workspace_bytes(const std::string& gpu);

/// Elements of Adafactor's factored second moments for the whole model (before partitioning):
/// Σ over matrices [rows, cols] of rows + cols (token embedding and an untied output included),
/// plus every vector parameter in full (ModelShape's block matrices and norms).
double adafactor_state_elements(const ModelShape& m);

/// A PyTorch process's CUDA lines on `gpu`: `handles` cuBLAS workspaces (device, inside
/// max_memory_allocated; training 2: the forward thread's and autograd's backward thread's;
/// generation 1) and the CUDA context (gpu-other: `context` when `given` by the user, else
/// measured on an H100, else `context` as an assumption).
void add_torch_cuda_lines(MemReport& r, const std::string& gpu, int handles, double context, bool given = false);

/// Bytes per trainable parameter of each model state (before any partitioning).
struct StateBytes {
  double weights = 0;  ///< the working copy the forward pass reads
  double grads = 0;
  double master = 0;   ///< fp32 master copy (mixed precision)
  double optim = 0;    ///< optimizer moments
  double k() const { return master + optim; }  ///< ZeRO's K
  double total() const { return weights + grads + master + optim; }
};
/// The per-parameter bytes of precision × optimizer for a framework: e.g. FP32 Adam 4+4+0+8 = 16;
/// Mixed Adam 2+2+4+8 (K = 12, ZeRO); Mixed under PyTorch autocast 4+4+0+8; 8-bit Adam 2 + 8/2048
/// bytes of moments (two fp32 absmax per block of 2048, 8BIT).
StateBytes state_bytes(Precision p, Optimizer o, Framework f);

/// Bytes of ψ parameters stored with `bytes_per_param` (1e9 fp32 = 4e9 B, 16-bit 2e9, int8 1e9).
inline double weights_bytes(double params, double bytes_per_param) { return params * bytes_per_param; }

/// Inference weight bytes per parameter of a storage format: "fp32" 4, "bf16"/"fp16" 2,
/// "int8" 1, llmq's block types by their block bytes (formats/quant.h: "q8_0" 34/32, "q4_0"
/// 18/32, "q4_1" 20/32, "q5_0" 22/32, "q5_1" 24/32, "q4_k" 144/256, "q5_k" 176/256, "q6_k"
/// 210/256), "nf4" 0.5 + 4/64, "nf4-dq" (4 + 0.127)/8 (QLORA). Throws UsageError for other names
/// (a mix such as q4_k_m has no single figure: the file's tensor sizes are exact).
double inference_bytes_per_param(const std::string& format);

/// ZeRO's model-state bytes per GPU for Ψ parameters (ZeRO §3, Fig. 1): stage 0: (2+2+K)Ψ;
/// 1: 4Ψ + KΨ/N_d; 2: 2Ψ + (2+K)Ψ/N_d; 3: (4+K)Ψ/N_d. K = 12 for mixed-precision Adam.
double zero_model_states(double params, int stage, int n_d, double k = 12);

/// DeepSpeed's estimate_zero2_model_states_mem_needs (DS), bytes {cpu, gpu}:
/// offload: gpu 2P, cpu P·max(4N, 16)·f; no offload: gpu 4P + 16P/N, cpu 4P·gpus_per_node·f;
/// N = nodes·gpus_per_node, f = additional_buffer_factor (1.5).
struct CpuGpu {
  double cpu = 0, gpu = 0;
};
CpuGpu ds_zero2_model_states(double params, int gpus_per_node, int nodes, bool cpu_offload, double buffer_factor = 1.5);
/// DeepSpeed's estimate_zero3_model_states_mem_needs (DS): largest = 4·largest_layer;
/// params+optimizer offload: gpu largest, cpu P·18·f/nodes (zero_init) or P·max(4·gpn, 18/nodes)·f;
/// optimizer offload: gpu largest + 2P/N, cpu P·16·f/nodes (zero_init) or P·max(4·gpn, 16/nodes)·f;
/// none: gpu largest + 18P/N, cpu largest_layer·4·gpn·f (zero_init) or 4P·gpn·f.
CpuGpu ds_zero3_model_states(double params, double largest_layer, int gpus_per_node, int nodes, bool offload_optimizer,
                             bool offload_params, bool zero_init = true, double buffer_factor = 1.5);

/// Whether a layer stores its s×s attention scores for the backward (the 5as²b term of
/// Korthikanti et al. 2022, arXiv 2205.05198, Table 2): not with FlashAttention (recomputed
/// tile by tile) and not under selective recomputation (recomputed with the attention).
bool attention_scores_kept(bool flash, Checkpointing ckpt);

/// KORTH activation bytes of one transformer layer with 16-bit activations: s, b, h, a, t as
/// in the paper. none: sbh(10 + 24/t + 5as/(ht)) (t = 1: sbh(34 + 5as/h)); sequence parallel:
/// sbh(34 + 5as/h)/t; FlashAttention or selective recomputation drop the 5as²b term; full
/// recomputation keeps 2sbh (the layer input; /t with sequence parallelism).
double korthikanti_layer_activations(double s, double b, double h, double a, int t, bool sequence_parallel,
                                     Checkpointing ckpt, bool flash);

/// The 1-byte dropout masks inside korthikanti_layer_activations' count, which stay 1 byte when
/// the activations are fp32: the attention-output and MLP-output masks 2sbh (/t with sequence
/// parallelism) and, when the s² matrices are kept, the attention-probability mask as²b/t
/// (KORTH §4.1). 0 under full recomputation.
double korthikanti_dropout_masks(double s, double b, double h, double a, int t, bool sequence_parallel, Checkpointing ckpt,
                                 bool flash);

/// True when TrainOptions::torch_version names a release before 1.11 (softmax keeps its input).
/// Throws UsageError for a malformed version.
bool softmax_keeps_input(const TrainOptions& o);

/// True when the LoRA targets name matrix `t` ("q", "o", "down", ...), or "all".
bool lora_targets_include(const TrainOptions& o, const char* t);

/// An adapted Linear's input and output widths (elements).
struct LoraDims {
  double in = 0, out = 0;
};

/// The widths of LoRA target `name` in m: q, k, v, qkv (a fused projection), o, gate, up, down;
/// head is counted apart ({0, 0}). Throws UsageError for an unknown name.
LoraDims lora_target_dims(const ModelShape& m, const std::string& name);

/// Whether LoRA adapters are fp32 on a 16-bit base: PEFT's get_peft_model(autocast_adapter_dtype=True),
/// as --lora-fp32-inputs says for the analytic framework and --framework transformers always models.
bool peft_fp32_adapters(const TrainOptions& o);

/// LoRA adapter parameters of one block: Σ over the block's targets r·(in + out) (Hu et al. 2021).
/// Throws UsageError for an unknown target.
double lora_layer_params_of(const ModelShape& m, const TrainOptions& o);

/// LitGPT's fine-tuning (Framework::LitGPT): what torch.cuda.max_memory_allocated() reports.
/// Throws UsageError for what the scripts do not do (TP/PP, offload, mixed precision).
MemReport litgpt_estimate(const ModelShape& m, const TrainOptions& o);

/// A transformers Llama-family model trained on one GPU (Framework::Transformers), fully or with
/// PEFT's LoRA / DoRA: what torch.cuda.max_memory_allocated() reports, the largest of the loss's
/// backward, the last layer's backward (recomputed under checkpointing), DoRA's weight norm in a
/// forward and the optimizer step. Throws UsageError for what it does not model (parallelism,
/// offload, QLoRA, mixed precision, other blocks, optimizers other than AdamW and SGD).
MemReport transformers_estimate(const ModelShape& m, const TrainOptions& o);

/// What PEFT's DoRA keeps per layer beyond LoRA (TrainOptions::dora), bytes on one GPU: for every
/// adapted Linear its base output and its LoRA output, s·b·out each, and with dropout a copy of
/// its weight when that is a cast or a dequantized NF4 matrix (PEFT d787f51bb dora.py).
double dora_layer_bytes(const ModelShape& m, const TrainOptions& o);

/// What PEFT's DoRA keeps for one adapted Linear [out, in] over `tokens` tokens (bytes): its base
/// and LoRA outputs, and with dropout the weight's copy, which F.linear keeps only when its input
/// needs a gradient (`input_grad`).
double dora_linear_bytes(const TrainOptions& o, double in, double out, double tokens, bool input_grad = true);

/// torchtune's single-device fine-tuning (Framework::TorchTune): the active / allocated peak of one
/// step, the larger of the loss's backward and the backward's end. Throws UsageError for what the
/// recipes do not do (data or model parallelism, mixed precision, other optimizers).
MemReport torchtune_estimate(const ModelShape& m, const TrainOptions& o);

/// "1.23457e+09": the number format of the report's formulas.
std::string num_str(double x);

/// The full per-GPU estimate (the largest pipeline stage when pp > 1). Throws UsageError for
/// impossible combinations (ZeRO with dp = 1 and stage > 0 is allowed: it changes nothing).
MemReport estimate_training(const ModelShape& m, const TrainOptions& o);

/// The rule of thumb "training takes about 6x the fp32 weights" (24 GB for 1B parameters:
/// 4 B weights + 4 B gradients + 8 B Adam + ~8 B activations/temporaries per parameter), as an
/// Info line, with the difference to `estimate` explained in its formula.
MemLine rule_of_thumb_line(const ModelShape& m, const MemReport& estimate);

}  // namespace llmq::mem
