// llmq-mem: will it fit, and where does the memory go? Answered before anything is loaded.
//
//   llmq-mem infer -m model.llmq --ctx 4096 --parallel 8        the engine's own allocation plan, per line
//   llmq-mem infer -m model.llmq --fit --mem 2GiB --json         largest context / sequences within a budget
//   llmq-mem train llama-2-7b --precision bf16 --zero 2 --dp 8   training memory per GPU, each line with its source
//
// Formulas and sources: docs/MEMORY.md.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "base/error.h"
#include "mem/generate.h"
#include "mem/infer.h"
#include "mem/train.h"
#include "cli/cli_common.h"
#include "engine/runner/model_file.h"

using namespace llmq;
using namespace llmq::mem;

namespace {

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  if (!out || !(out << text)) throw UsageError("cannot write " + path);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) v.push_back(item);
  return v;
}

void emit(const MemReport& r, bool json, const std::string& svg) {
  if (json) std::printf("%s\n", report_json(r).dump(2).c_str());
  else std::printf("%s", render_table(r).c_str());
  if (!svg.empty()) write_file(svg, render_svg({r}));
}

// llmq-mem infer's flags.
struct InferCli {
  std::string model_path, mem_budget, svg;
  InferOptions io;
  bool fit = false, json = false, ctx_given = false, parallel_given = false;
};

// --fit --device cuda: the most layers on the GPU within --gpu-mem (llmq-run --gpu-layers auto).
int fit_gpu(const InferCli& a) {
  const InferOptions& io = a.io;
  if (!io.budget) throw UsageError("--fit --device cuda needs --gpu-mem (the GPU memory to plan for)");
  auto f = LlmqFile::open(a.model_path, false);
  const ModelConfig c = file_config(*f);
  const int64_t n = fit_gpu_layers(*f, c, io, *io.budget);
  InferOptions o = io;
  o.gpu_layers = n;
  const nlohmann::json j = {{"fits", n >= 0}, {"gpu_budget", std::llround(*io.budget)}, {"gpu_layers", n}, {"n_layers", c.n_layers},
                            {"gpu_total", n >= 0 ? plan_cuda(c, f->tensors(), io.ctx, io.n_batch, 1, n).total() : 0},
                            {"note", "the CUDA context (measured at load by llmq-run) is not included: leave room for it"}};
  std::printf("%s\n", j.dump(a.json ? 2 : -1).c_str());
  if (n >= 0 && !a.svg.empty()) write_file(a.svg, render_svg({infer_report(a.model_path, o)}));
  return n >= 0 ? 0 : 3;
}

// --fit on the CPU: the largest context, then the most parallel sequences, within the budget.
int fit_cpu(const InferCli& a) {
  const double budget = a.io.budget ? *a.io.budget : double(available_memory());
  if (budget <= 0) throw UsageError("--fit needs --mem (MemAvailable is unknown here)");
  auto f = LlmqFile::open(a.model_path, false);
  const ModelConfig c = file_config(*f);
  const FitResult r = fit_inference(*f, c, a.io, budget, a.ctx_given, a.parallel_given);
  std::printf("%s\n", fit_json(r, budget).dump(a.json ? 2 : -1).c_str());
  if (!a.svg.empty()) {
    InferOptions o = r.options;
    o.budget = budget;
    write_file(a.svg, render_svg({infer_report(a.model_path, o)}));
  }
  return r.fits ? 0 : 3;
}

int run_infer(InferCli& a) {
  a.model_path = model_file_for(a.model_path);  // a GGUF: its cached conversion, as llmq-run loads it
  if (!a.mem_budget.empty()) a.io.budget = parse_size(a.mem_budget);
  if (a.fit) return a.io.device == "cuda" ? fit_gpu(a) : fit_cpu(a);
  emit(infer_report(a.model_path, a.io), a.json, a.svg);
  return 0;
}

// llmq-mem train's flags.
struct TrainCli {
  std::string model_spec, precision = "mixed", optimizer = "adamw", ckpt = "none", off_opt = "none", off_par = "none",
                          framework = "analytic", targets = "q,k,v,o", fsdp, gpu_mem, svg;
  TrainOptions to;
  double context_mib = -1;  // --cuda-context (< 0: not given)
  double lora_dropout = 0.05;
  const CLI::Option* lora_dropout_opt = nullptr;  // given or not: the framework's default when not
  bool no_flash = false, no_dq = false, rule = false, json = false;
};

int run_train(TrainCli& a) {
  TrainOptions& to = a.to;
  to.precision = precision_from_name(a.precision);
  to.optimizer = optimizer_from_name(a.optimizer);
  to.checkpointing = checkpointing_from_name(a.ckpt);
  to.offload_optimizer = offload_from_name(a.off_opt);
  to.offload_params = offload_from_name(a.off_par);
  to.framework = framework_from_name(a.framework);
  to.flash_attention = !a.no_flash;
  to.double_quant = !a.no_dq;
  to.lora_targets = split_commas(a.targets);
  // PEFT's LoraConfig defaults to no dropout (--framework transformers, --dora), LitGPT to 0.05
  // (TrainOptions' default).
  if (a.lora_dropout_opt != nullptr && a.lora_dropout_opt->count() > 0) to.lora_dropout = a.lora_dropout;
  else if (to.framework == Framework::Transformers || to.dora) to.lora_dropout = 0;
  if (a.context_mib >= 0) {
    if (!(a.context_mib <= 1 << 20)) throw UsageError("--cuda-context must be a number of MiB up to 1048576");
    to.cuda_context_bytes = a.context_mib * (1 << 20), to.cuda_context_given = true;
  }
  if (!a.fsdp.empty()) {
    if (a.fsdp == "full") to.zero = 3;
    else if (a.fsdp == "grad-op") to.zero = 2;
    else throw UsageError("--fsdp must be full or grad-op");
    to.fsdp = true;
  }
  const ModelShape shape = load_shape(a.model_spec);
  MemReport r = estimate_training(shape, to);
  if (!a.gpu_mem.empty()) r.budget = parse_size(a.gpu_mem);
  if (a.rule) r.lines.push_back(rule_of_thumb_line(shape, r));
  emit(r, a.json, a.svg);
  return 0;
}

// llmq-mem generate's flags.
struct GenerateCli {
  std::string model_spec, svg;
  GenerateOptions go;
  bool no_flash = false, json = false;
};

int run_generate(GenerateCli& a) {
  a.go.flash = !a.no_flash;
  emit(estimate_generate(load_shape(a.model_spec), a.go), a.json, a.svg);
  return 0;
}

// The infer subcommand, and the options whose presence --fit keeps (--ctx, --parallel).
struct InferCommand {
  CLI::App* app = nullptr;
  CLI::Option* ctx = nullptr;
  CLI::Option* parallel = nullptr;
};

// llmq-mem infer's flags, into ia.
InferCommand add_infer_command(CLI::App& app, InferCli& ia) {
  auto* inf = app.add_subcommand("infer", "memory of llmq-run / llmq-server for a .llmq model (exact on the CPU)");
  InferOptions& io = ia.io;
  inf->add_option("model,-m,--model", ia.model_path,
                 "model file (.llmq, or a GGUF: converted once into the cache, as llmq-run does); positional, as train's")
      ->required();
  auto* ctx_opt = inf->add_option("-c,--ctx", io.ctx, "tokens per sequence (default: the model's context, at most 4096)");
  auto* par_opt = inf->add_option("--parallel", io.parallel, "sequences at once (> 1: llmq-server's plan)");
  inf->add_flag("--server", io.server, "plan llmq-server even for one sequence");
  inf->add_option("--kv-tokens", io.kv_tokens, "server KV cache in tokens (default as llmq-server: max(ctx, parallel x min(ctx, 2048)))");
  inf->add_option("-b,--batch", io.n_batch, "most tokens per forward pass");
  inf->add_option("-t,--threads", io.threads, "threads (default: all cores; per-thread scratch depends on it)");
  inf->add_option("--kv-type", io.kv_type, "KV cache type: f32 or bf16 (the CPU engine), f16 or q8_0 (CUDA)");
  inf->add_option("--device", io.device, "cpu or cuda: the plan the engine allocates from (GPU 0; with --tp, weights and KV per rank only)");
  inf->add_option("--gpu-layers,--n-gpu-layers", io.gpu_layers, "with --device cuda: the last N layers on the GPU, the rest on the CPU (llmq-run's partial offload)");
  inf->add_option("--tp", io.tp, "tensor-parallel ranks: weights and KV per rank by the Megatron split (report only)");
  inf->add_option("--mem,--gpu-mem", ia.mem_budget, "memory budget, e.g. 8GiB (default for --fit: MemAvailable)");
  inf->add_flag("--fit", ia.fit,
                "pick the largest context (multiple of 16), then the most parallel sequences, that fit the budget; print the plan "
                "as JSON. --ctx / --parallel given are kept. GPU layer offload (--gpu-layers) needs the CUDA backend: not available yet");
  inf->add_flag("--json", ia.json, "JSON output");
  inf->add_option("--svg", ia.svg, "also write a stacked bar chart to this SVG file");
  return {inf, ctx_opt, par_opt};
}

// llmq-mem train's flags, into ta.
void add_train_command(CLI::App& app, TrainCli& ta) {
  auto* tr = app.add_subcommand("train", "peak memory per GPU of training / fine-tuning, line by line with formulas and sources");
  TrainOptions& to = ta.to;
  tr->add_option("model", ta.model_spec,
                 "a preset (" + [] {
                   std::string s;
                   for (const auto& n : preset_names()) s += (s.empty() ? "" : ", ") + n;
                   return s;
                 }() + "), a .llmq or .gguf file, a config.json or a directory holding one")
      ->required();
  tr->add_option("--precision", ta.precision, "fp32 | fp16 / bf16 / mixed (16-bit compute, fp32 master) | pure-bf16");
  tr->add_option("--optimizer", ta.optimizer, "adam | adamw | adam8bit | sgd | sgd-momentum | adafactor");
  tr->add_option("-b,--micro-batch", to.micro_batch, "sequences per GPU per forward pass");
  tr->add_option("-s,--seq", to.seq_len, "sequence length");
  tr->add_option("--grad-accum", to.grad_accum, "micro-batches per optimizer step");
  tr->add_option("--checkpointing", ta.ckpt, "activation checkpointing: none | selective | full");
  tr->add_flag("--no-flash", ta.no_flash, "attention materializes the s x s matrices (no FlashAttention)");
  tr->add_option("--lora-rank", to.lora_rank, "LoRA rank (0: full fine-tuning)");
  tr->add_option("--lora-targets", ta.targets, "LoRA target matrices: q,k,v,o,gate,up,down,head or all");
  tr->add_flag("--qlora", to.qlora, "QLoRA: NF4 base weights (with --lora-rank)");
  tr->add_flag("--no-double-quant", ta.no_dq, "QLoRA without double quantization of the NF4 constants");
  tr->add_option("--dp", to.dp, "data-parallel ranks N_d (DDP or ZeRO)");
  tr->add_option("--zero", to.zero, "ZeRO stage 0-3");
  tr->add_option("--fsdp", ta.fsdp, "FSDP sharding: full (= ZeRO-3) or grad-op (= ZeRO-2)");
  tr->add_flag("--fsdp-embedding-units", to.fsdp_embedding_units,
               "FSDP: the token embedding and the output head are units of their own (torchtune's custom_sharded_layers)");
  tr->add_option("--offload-optimizer", ta.off_opt, "none | cpu | nvme");
  tr->add_option("--offload-params", ta.off_par, "none | cpu | nvme (ZeRO-3)");
  tr->add_option("--tp", to.tp, "tensor-parallel degree");
  tr->add_option("--pp", to.pp, "pipeline-parallel degree (1F1B)");
  tr->add_flag("--sp", to.sequence_parallel, "sequence parallelism (with --tp)");
  tr->add_option("--framework", ta.framework,
                 "analytic (papers) | pytorch (bench/train_mem.py, allocator included) | deepspeed | litgpt (LitGPT's finetune scripts) | "
                 "torchtune (its single-device and FSDP recipes) | transformers (a Llama-family model, full or PEFT LoRA / DoRA, one GPU)");
  tr->add_flag("--compile", to.compile, "with --framework torchtune: compile=True (per-layer torch.compile)");
  tr->add_option("--ce-chunks", to.ce_chunks, "torchtune's CEWithChunkedOutputLoss chunks (0: CrossEntropyLoss); torchtune and analytic frameworks");
  tr->add_flag("--offload-activations", to.offload_activations, "with --framework torchtune: enable_activation_offloading=True");
  tr->add_flag("--optimizer-in-backward", to.optimizer_in_backward, "with --framework torchtune: optimizer_in_bwd=True");
  tr->add_flag("--paged-optimizer", to.paged_optimizer, "bitsandbytes paged optimizer: states in CUDA managed memory, outside torch's count");
  tr->add_option("--block", to.block, "with --framework litgpt: the block recipe: llama, gemma, gemma2, phi3, mistral, qwen2, gpt-neox, phi, falcon");
  tr->add_option("--litgpt-version", to.litgpt_version, "with --framework litgpt: 2023 (lit-gpt 8641822) or 2024 (litgpt 00af8b0d)");
  ta.lora_dropout_opt = tr->add_option("--lora-dropout", ta.lora_dropout,
                 "LoRA dropout probability in [0, 1) (default: LitGPT's 0.05; with --framework transformers or --dora PEFT's 0)");
  tr->add_flag("--lora-fp32-inputs", to.lora_fp32_inputs,
               "PEFT's LoRA on a pure-bf16 base: adapters in fp32 (autocast_adapter_dtype), each adapted Linear's input kept as an "
               "fp32 copy");
  tr->add_flag("--padded", to.padded,
               "with --framework transformers: batches padded to their longest sequence (an attention mask: SDPA keeps its bias, K and V "
               "repeated to the query heads)");
  tr->add_flag("--dora", to.dora,
               "PEFT's DoRA (use_dora): a magnitude per output feature, and each adapted Linear's base and LoRA outputs kept");
  tr->add_option("--torch-version", to.torch_version,
                 "PyTorch release the recipe runs on (default: a current one); before 1.11 softmax keeps its input for the backward, "
                 "so eager attention keeps its scores twice");
  tr->add_option("--gpu-mem", ta.gpu_mem, "GPU memory to check against, e.g. 80GB");
  tr->add_option("--gpu", to.gpu, "GPU model, e.g. H100 or A100 (PyTorch's cuBLAS workspace is 32 MiB on sm_90, 8 MiB elsewhere; "
                                  "the CUDA context is measured for the H100)");
  tr->add_option("--cuda-context", ta.context_mib,
                 "MiB of GPU memory a process holds before its first tensor on your setup (CUDA context, kernels, libraries: "
                 "nvidia-smi after initialising CUDA); default an assumed 512 MiB, or the H100's measured one");
  tr->add_flag("--rule-of-thumb", ta.rule, "add the '6x the weights' rule of thumb beside the estimate, with the difference explained");
  tr->add_flag("--json", ta.json, "JSON output");
  tr->add_option("--svg", ta.svg, "also write a stacked bar chart to this SVG file");
}

// llmq-mem generate's flags, into ga.
CLI::App* add_generate_command(CLI::App& app, GenerateCli& ga) {
  auto* gen = app.add_subcommand("generate", "GPU memory of generation with transformers, LitGPT or torchtune (bf16, int8, 4-bit)");
  gen->add_option("model", ga.model_spec, "a preset, a .llmq or .gguf file, a config.json or a directory holding one")->required();
  gen->add_option("--framework", ga.go.framework, "transformers | litgpt | torchtune");
  gen->add_option("--weights", ga.go.weights, "bf16 | fp16 | int8 (LLM.int8) | nf4 | nf4-dq | fp4 (bitsandbytes)");
  gen->add_option("-b,--batch", ga.go.batch, "sequences");
  gen->add_option("--prompt", ga.go.prompt, "prompt tokens");
  gen->add_option("--new-tokens", ga.go.new_tokens, "generated tokens");
  gen->add_option("--kv-len", ga.go.kv_len, "KV-cache positions (default: prompt + new tokens; torchtune: the model's max_seq_len)");
  gen->add_option("--compute-bytes", ga.go.compute_bytes, "bitsandbytes 4-bit compute dtype bytes (2: bf16, 4: float32)");
  gen->add_flag("--no-flash", ga.no_flash, "eager attention (the prefill keeps the score matrices)");
  gen->add_option("--transformers-version", ga.go.transformers_version,
                  "transformers release (default 5.0): before 4.45 (and for some model types until 5.0) the prefill computes every "
                  "prompt position's logits");
  gen->add_option("--gpu", ga.go.gpu, "GPU model, e.g. H100 (sizes PyTorch's cuBLAS workspace; the H100's context is measured)");
  gen->add_flag("--json", ga.json, "JSON output");
  gen->add_option("--svg", ga.svg, "also write a stacked bar chart to this SVG file");
  return gen;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-mem: memory of inference (the engine's allocation plan) and of training (per GPU), before loading"};
  app.require_subcommand(1);
  InferCli ia;
  TrainCli ta;
  GenerateCli ga;

  // ---- infer
  const auto [inf, ctx_opt, par_opt] = add_infer_command(app, ia);

  // ---- train
  add_train_command(app, ta);

  // ---- generate
  CLI::App* gen = add_generate_command(app, ga);

  LLMQ_CLI_PARSE(app, argc, argv);

  return cli::run_guarded("llmq-mem", [&] {
    if (gen->parsed()) return run_generate(ga);
    if (!inf->parsed()) return run_train(ta);
    ia.ctx_given = ctx_opt->count() > 0, ia.parallel_given = par_opt->count() > 0;
    return run_infer(ia);
  });
}
