// llmq-run: generate text from a `.llmq` model (one-shot or interactive), or measure perplexity.
//
//   llmq-run -m model.llmq -p "Once upon a time" -n 128 --temp 0      one-shot, streamed
//   llmq-run -m model.llmq                                             interactive (chat with a template)
//   llmq-run -m model.llmq --perplexity text.txt --ctx 256             llama.cpp-method PPL
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "text/chat.h"
#include "engine/runner/device.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "text/tokenizer.h"
#include "engine/parallel/comm_socket.h"
#include "engine/tp.h"
#include "engine/parallel/tp_process.h"
#include "base/error.h"
#include "mem/infer.h"
#include "cli/cli_common.h"

using namespace llmq;

namespace {

std::atomic<bool> g_generating{false};
std::atomic<bool> g_stop{false};

// Ctrl-C stops the current generation; at the prompt it ends the program.
void on_sigint(int) {
  if (g_generating.load()) {
    g_stop.store(true);
  } else {
    const char nl = '\n';
    (void)!write(STDOUT_FILENO, &nl, 1);
    _exit(130);
  }
}

void print_stats(const GenerateStats& st) {
  std::fprintf(stderr,
               "\nllmq-run: prompt %lld tokens, %.1f tok/s prefill | generated %lld tokens, %.1f tok/s decode | peak memory %s\n",
               (long long)st.prompt_tokens, st.prefill_tps(), (long long)st.generated_tokens, st.decode_tps(),
               cli::human_bytes(cli::peak_rss_bytes()).c_str());
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"llmq-run: generate text with a .llmq model"};
  std::string model_path, prompt, ppl_file, template_name, system_prompt;
  bool have_prompt = false, no_verify = false, use_chat = false;
  int64_t n_predict = 256, ctx = 0, n_batch = 512;
  int threads = 0, tp = 1;
  SamplerParams sp;
  sp.seed = 0;
  int64_t seed = -1, ppl_chunks = 0;
  app.add_option("-m,--model", model_path, "model file (.llmq)")->required();
  auto* popt = app.add_option("-p,--prompt", prompt, "prompt; without it llmq-run is an interactive chat");
  app.add_option("-n,--n-predict", n_predict, "tokens to generate (-1: until end of sequence)");
  app.add_option("-t,--threads", threads, "threads in all (default: all cores); with --tp they are shared by the ranks");
  app.add_option("--tp", tp, "tensor-parallel ranks: split every layer over N ranks (CPU: rank threads in this process; --device cuda: one rank per GPU over NCCL when N GPUs are present, else N ranks on GPU 0 with a host all-reduce)");
  std::string tp_init;
  int tp_rank = 0;
  cli::add_tp_process_flags(app, tp_init, tp_rank, "generates");
  app.add_option("-c,--ctx", ctx, "context length, KV cache size in tokens (default: the model's, at most 4096)");
  app.add_option("-b,--batch", n_batch, "most tokens per forward pass during prefill");
  std::string kv_type_s = "f32";
  app.add_option("--kv-type", kv_type_s, "KV cache element type: f32, or bf16 (half the memory; attention on bf16 operands); "
                                        "--device cuda: f16 (default) or q8_0 (17/32 of f16's bytes)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "q8_0"}));
  std::string device_s = "cpu";
  app.add_option("--device", device_s, "where the forward pass runs: cpu, cuda (GPU 0; f16 KV cache) or auto (the GPU when one is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--temp", sp.temperature, "temperature (0: greedy)");
  app.add_option("--top-k", sp.top_k, "top-k (0: off)");
  app.add_option("--top-p", sp.top_p, "top-p (1: off)");
  app.add_option("--min-p", sp.min_p, "min-p (0: off)");
  app.add_option("--repeat-penalty", sp.repeat_penalty, "repetition penalty (1: off)");
  app.add_option("--repeat-last-n", sp.repeat_last_n, "tokens the repetition penalty looks back on");
  app.add_option("-s,--seed", seed, "random seed (default: from the clock)");
  app.add_option("--perplexity", ppl_file, "compute perplexity over this text file instead of generating");
  app.add_option("--chunks", ppl_chunks, "perplexity: score only the first N chunks (0: all)");
  app.add_option("--chat-template", template_name, "chat template name, overriding the model's (chatml, llama2, llama3, mistral, zephyr, gemma, phi3)");
  app.add_option("--system", system_prompt, "system prompt for chat mode");
  app.add_flag("--chat", use_chat, "format -p as a user message with the chat template (interactive mode chats whenever the model has a template)");
  app.add_flag("--no-verify", no_verify, "skip the tensor checksum verification at load");
  bool fit = false;
  std::string mem_budget;
  app.add_flag("--fit", fit,
               "before loading, pick the largest context (multiple of 16, at most the model's) that fits --mem and print the "
               "plan as JSON on stderr (llmq-mem infer --fit); with --device cuda: --gpu-layers auto within --mem or the GPU's free "
               "memory");
  app.add_option("--mem", mem_budget, "memory budget for --fit, e.g. 2GiB (default: MemAvailable)");
  std::string gpu_layers_s = "all";
  app.add_option("--gpu-layers,--n-gpu-layers", gpu_layers_s,
                 "with --device cuda: the last N layers (and the output) on the GPU, the others on the CPU (partial offload); "
                 "'auto': as many as fit the GPU's free memory (or --mem) by llmq-mem's plan; default: all");
  LLMQ_CLI_PARSE(app, argc, argv);
  have_prompt = popt->count() > 0;

  return cli::run_guarded("llmq-run", [&] {
    const Device device = pick_device(device_s);
    cli::check_tp_flags(tp_init, tp_rank, tp);
    if (fit && device == Device::Cuda) {  // on the GPU, --fit picks the layers that fit (--gpu-layers auto)
      if (gpu_layers_s != "all" && gpu_layers_s != "auto") throw UsageError("--fit with --device cuda chooses --gpu-layers itself");
      gpu_layers_s = "auto";
    }
    if (fit && device == Device::Cpu) {  // plan first, from the file's metadata and tensor directory only
      if (!ppl_file.empty()) throw UsageError("--fit plans generation, not --perplexity");
      const double budget = mem_budget.empty() ? double(mem::available_memory()) : mem::parse_size(mem_budget);
      auto f = LlmqFile::open(model_path, false);
      const LlamaConfig c = mem::file_config(*f);
      mem::InferOptions o;
      o.ctx = ctx, o.n_batch = n_batch, o.threads = threads, o.kv_type = kv_type_s;
      const mem::FitResult r = mem::fit_inference(*f, c, o, budget, ctx > 0, true);
      std::fprintf(stderr, "llmq-run: fit plan: %s\n", mem::fit_json(r, budget).dump().c_str());
      if (!r.fits) throw UsageError("the model does not fit in " + cli::human_bytes(uint64_t(budget)) + " even with the smallest context");
      ctx = r.options.ctx;
    }
    if (device == Device::Cuda && kv_type_s != "f32" && kv_type_s != "f16" && kv_type_s != "q8_0")
      throw UsageError("--kv-type with --device cuda: f16 (the default) or q8_0");
    const bool gpu_kv_q8 = device == Device::Cuda && kv_type_s == "q8_0";
    const KvType kv_type = device == Device::Cuda ? KvType::F32 : kv_type_from_name(kv_type_s);  // the CPU's (partial offload: f32)
    mem::InferOptions lo;
    lo.ctx = ctx, lo.n_batch = n_batch;
    const int64_t gpu_layers = cli::resolve_gpu_layers("llmq-run", gpu_layers_s, device == Device::Cuda, model_path, lo, mem_budget);
    // The CPU kernels' packed copies only for what the CPU runs (engine/model.h; with -ngl 0 the
    // output is packed too, unused).
    auto model = Model::load(model_path, !no_verify, /*pack=*/device == Device::Cpu || gpu_layers >= 0,
                             /*gpu_layers=*/device == Device::Cpu ? 0 : gpu_layers, tp);
    const bool partial = device == Device::Cuda && gpu_layers >= 0 && gpu_layers < model->config.n_layers;
    const Tokenizer& tok = *model->tokenizer;
    sp.seed = seed >= 0 ? uint64_t(seed) : uint64_t(time(nullptr));
    const int64_t ppl_ctx = ctx > 0 ? ctx : 512;
    // TP = 1: one pool of `threads` and the planned workspace (what llmq-mem infer reports);
    // --tp N: N rank threads sharing `threads`, each with its slices of the weights.
    std::unique_ptr<ThreadPool> pool;
    const int64_t tp_cap = ppl_file.empty() ? session_sizes(model->config, ctx, n_batch).n_batch : ppl_ctx;
    // --tp-init: the ranks are processes (engine/parallel/tp_process.h), each holding its own rank; those
    // other than 0 serve rank 0 and end here.
    if (!tp_init.empty()) {
      cli::check_tp_flags(tp_init, tp_rank, tp, partial);
      if (device == Device::Cuda && !ppl_file.empty())
        throw UsageError("--perplexity with --tp-init --device cuda: the GPU ranks keep one logits row (use the CPU ranks, or one process)");
    }
    cli::TpRunnerSpec spec;  // rank 0's sizes; the other ranks receive them at the join
    spec.cuda = device == Device::Cuda, spec.capacity = tp_cap, spec.ctx = session_sizes(model->config, ctx, n_batch).ctx;
    spec.n_batch = n_batch, spec.parallel = 1, spec.kv_tokens = 0, spec.kv_q8 = gpu_kv_q8;
    std::unique_ptr<SocketComm> group = cli::join_tp_group("llmq-run", tp_init, tp_rank, tp, *model, spec);
    std::unique_ptr<BatchRunner> local;  // this process's rank of the group
    std::unique_ptr<BatchRunner> runner;
    if (group) {
      local = cli::make_tp_rank_runner("llmq-run", *model, *group, spec, threads);
      if (tp_rank > 0) return cli::serve_tp_rank("llmq-run", *local, *group);
      runner = std::make_unique<ProcessGroupRunner>(*local, *group);
    } else if (device == Device::Cuda && !partial) {
      // the GPU runs everything but sampling (--tp N: N ranks on it, engine/cuda/session.h CudaTpSession)
    } else if (tp == 1) {
      pool = std::make_unique<ThreadPool>(threads);
    } else {
      auto t = std::make_unique<TensorParallel>(*model, tp, threads, tp_cap);
      std::fprintf(stderr, "llmq-run: tensor parallel over %d ranks, %d threads in all\n", t->size(), t->threads());
      for (int r = 0; r < t->size(); ++r) std::fprintf(stderr, "  %s\n", cli::describe_rank(t->shard(r), t->rank_threads(r)).c_str());
      runner = std::move(t);
    }

    if (!ppl_file.empty()) {
      const int64_t n_ctx = ppl_ctx;
      const std::string text = read_text_file(ppl_file);
      const std::vector<int32_t> tokens = tok.encode(text, true);
      std::fprintf(stderr, "llmq-run: perplexity over %s: %zu tokens, %lld chunks of %lld\n", ppl_file.c_str(), tokens.size(),
                   (long long)(int64_t(tokens.size()) / n_ctx), (long long)n_ctx);
      const auto progress = [](int64_t i, double ppl) { std::fprintf(stderr, "[%lld] %.4f\n", (long long)i + 1, ppl); };
      std::unique_ptr<SessionBase> gpu;
      if (device == Device::Cuda) gpu = make_cuda_session(*model, n_ctx, n_ctx, n_ctx, true, gpu_layers, pool.get(), tp, gpu_kv_q8);
      const PerplexityResult r = gpu      ? perplexity(*gpu, tokens, n_ctx, progress, ppl_chunks)
                                 : runner ? perplexity(*runner, tokens, n_ctx, progress, ppl_chunks, kv_type)
                                          : perplexity(*model, *pool, tokens, n_ctx, progress, ppl_chunks, kv_type);
      std::printf("PPL = %.4f +/- %.4f (%lld chunks, %lld tokens scored, ctx %lld, model %s)\n", r.ppl, r.ppl_err,
                  (long long)r.chunks, (long long)r.scored, (long long)n_ctx, model->weight_type().c_str());
      return 0;
    }

    std::unique_ptr<SessionBase> session_ptr;
    if (group) session_ptr = std::make_unique<Session>(*runner, ctx, kv_type);
    else if (device == Device::Cuda)
      session_ptr = make_cuda_session(*model, ctx, n_batch, 1, true, gpu_layers, pool.get(), tp, gpu_kv_q8);  // prints the GPU's memory
    else if (runner) session_ptr = std::make_unique<Session>(*runner, ctx, kv_type);
    else session_ptr = std::make_unique<Session>(*model, *pool, ctx, n_batch, 1, kv_type);
    SessionBase& session = *session_ptr;
    // Measured at load: bytes of our own buffers (the mapping, the weights the CPU kernels
    // repacked, the KV cache, the workspace), what llmq-mem infer predicts.
    const uint64_t file_bytes = model->file->file_size(), packed = model->packed.bytes();
    const uint64_t mem_total = file_bytes + packed + session.state_bytes();
    if (device == Device::Cpu)
      std::fprintf(stderr,
                 "llmq-run: memory: model file %s (weights %s), repacked weights %s, KV cache %s (%s), workspace %s; total %llu bytes "
                 "(%s), ctx %lld\n",
                 cli::human_bytes(file_bytes).c_str(), cli::human_bytes(model->weight_bytes()).c_str(), cli::human_bytes(packed).c_str(),
                 cli::human_bytes(session.kv_bytes()).c_str(), kv_type_name(kv_type), cli::human_bytes(session.workspace_bytes()).c_str(),
                 (unsigned long long)mem_total, cli::human_bytes(mem_total).c_str(), (long long)session.ctx());
    Sampler sampler(sp);
    const std::vector<int32_t> stop_ids = default_stop_ids(model->vocab);
    std::vector<int32_t> history;  // every token of the conversation (prompt and replies)
    int32_t prev = -1;
    std::string reply;
    auto emit = [&](int32_t id) {
      const std::string piece = tok.decode_piece(prev, id);
      prev = id;
      reply += piece;
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    };
    auto check_fits = [&](size_t n) {
      if (int64_t(n) >= session.ctx())
        throw UsageError("the prompt has " + std::to_string(n) + " tokens; the context is " + std::to_string(session.ctx()));
    };

    // Chat mode: the conversation is formatted with the model's template (or --chat-template)
    // and re-tokenized each turn; the KV cache keeps the prefix that did not change.
    const bool chat_mode = use_chat || (!have_prompt && (!template_name.empty() || !model->chat_template.empty()));
    std::optional<ChatTemplate> tmpl;
    if (chat_mode) {
      if (!template_name.empty()) tmpl = ChatTemplate::by_name(template_name);
      else if (!model->chat_template.empty()) tmpl = ChatTemplate::from_jinja(model->chat_template);
      else throw UsageError("the model has no chat template: name one with --chat-template (" + std::string("chatml, llama2, ...") + ")");
    }
    std::vector<ChatMessage> messages;
    if (!system_prompt.empty()) messages.push_back({"system", system_prompt});
    const std::string bos_text = model->vocab.bos_id >= 0 ? model->vocab.tokens[size_t(model->vocab.bos_id)] : "";
    auto chat_turn = [&](const std::string& user) {
      messages.push_back({"user", user});
      const std::string text = tmpl->apply(messages, true);
      const bool add_bos = model->vocab.add_bos && (bos_text.empty() || text.rfind(bos_text, 0) != 0);
      std::vector<int32_t> want = tok.encode(text, add_bos, /*parse_special=*/true);
      check_fits(want.size() + 1);
      size_t common = 0;
      while (common + 1 < want.size() && common < history.size() && int64_t(common) < session.pos() &&
             history[common] == want[common])
        ++common;
      session.truncate(int64_t(common));
      history = std::move(want);
      prev = history.back();
      reply.clear();
    };

    if (have_prompt) {
      if (chat_mode) {
        chat_turn(prompt);
      } else {
        history = tok.encode(prompt, model->vocab.add_bos);
        if (history.empty()) throw UsageError("the prompt is empty and the model adds no BOS token");
        check_fits(history.size());
        for (int32_t id : history) emit(id);  // echo the prompt as the model sees it
      }
      const GenerateStats st = generate(session, sampler, history, n_predict, stop_ids, emit);
      std::printf("\n");
      print_stats(st);
      return 0;
    }

    // Interactive: each line is a user turn (chat mode) or continues the text; the KV cache
    // is kept between turns.
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    const bool tty = isatty(STDIN_FILENO);
    std::fprintf(stderr, "llmq-run: %s; Ctrl-C stops a reply, /reset forgets, /quit or end of input exits\n",
                 chat_mode ? ("chat (template " + tmpl->name() + ")").c_str() : "interactive text continuation");
    GenerateStats total;
    std::string line;
    auto reset = [&] {
      session.reset();
      history.clear();
      messages.clear();
      if (!system_prompt.empty()) messages.push_back({"system", system_prompt});
      prev = -1;
    };
    for (;;) {
      if (tty) std::fprintf(stderr, "> ");
      if (!std::getline(std::cin, line)) break;
      if (line == "/quit" || line == "/exit") break;
      if (line == "/reset") {
        reset();
        std::fprintf(stderr, "(conversation reset)\n");
        continue;
      }
      if (line.empty()) continue;
      try {
        if (chat_mode) {
          try {
            chat_turn(line);
          } catch (const UsageError&) {  // context full: start over with this message alone
            std::fprintf(stderr, "(context full: conversation reset)\n");
            reset();
            chat_turn(line);
          }
        } else {
          std::vector<int32_t> add = tok.encode(line, history.empty() && model->vocab.add_bos);
          if (int64_t(history.size() + add.size()) + 1 >= session.ctx()) {
            std::fprintf(stderr, "(context full: conversation reset)\n");
            reset();
            add = tok.encode(line, model->vocab.add_bos);
            check_fits(add.size() + 1);
          }
          history.insert(history.end(), add.begin(), add.end());
          prev = add.back();
        }
      } catch (const UsageError& e) {
        std::fprintf(stderr, "(%s)\n", e.what());
        reset();
        continue;
      }
      g_stop = false;
      g_generating = true;
      const GenerateStats st = generate(session, sampler, history, n_predict, stop_ids, emit, &g_stop);
      g_generating = false;
      std::printf("\n");
      std::fflush(stdout);
      if (g_stop) std::fprintf(stderr, "(stopped)\n");
      if (chat_mode) messages.push_back({"assistant", reply});
      total.prompt_tokens += st.prompt_tokens, total.generated_tokens += st.generated_tokens;
      total.prefill_s += st.prefill_s, total.decode_s += st.decode_s;
    }
    print_stats(total);
    return 0;
  });
}
